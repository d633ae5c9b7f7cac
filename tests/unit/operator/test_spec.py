"""The spec parser: defaults, every model source, and a precise message for each bad input."""

from __future__ import annotations

from typing import Any

import pytest

from berth_operator import constants as c
from berth_operator.spec import InferenceService, InferenceServiceSpec, SpecError

from .factories import FULL_SPEC, isvc_body, parse


def problems(spec: dict[str, Any] | None = None, **body: Any) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse(spec, **body)
    return info.value.problems


def test_empty_spec_serves_the_builtin_model_with_one_rank_and_a_router() -> None:
    spec = InferenceServiceSpec.from_spec({})
    assert spec.model.source == "builtin"
    assert spec.model.uri == "builtin://smollm2-135m-instruct"
    assert spec.replicas == spec.ranks == 1
    assert spec.routing.policy == "cacheAware"
    assert spec.routing.router_replicas == 1
    assert spec.runtime.image == c.DEFAULT_RUNTIME_IMAGE
    assert spec.resources.gpus == 0
    assert spec.ingress is None and spec.api_key is None


def test_none_spec_is_the_same_as_empty() -> None:
    assert InferenceServiceSpec.from_spec(None) == InferenceServiceSpec.from_spec({})


def test_default_image_comes_from_the_operator_unless_the_spec_sets_one() -> None:
    assert InferenceServiceSpec.from_spec({}, default_image="x/y:1").runtime.image == "x/y:1"
    spec = InferenceServiceSpec.from_spec({"runtime": {"image": "a/b:2"}}, default_image="x/y:1")
    assert spec.runtime.image == "a/b:2"


def test_full_spec_parses_every_field() -> None:
    isvc = parse(FULL_SPEC)
    spec = isvc.spec
    assert isvc.name == "chat" and isvc.namespace == "team-a" and isvc.generation == 1
    assert spec.model.hf_repo == "meta-llama/Llama-3.1-8B-Instruct"
    assert spec.model.hf_file is None
    assert spec.model.revision == "v1.0"
    assert spec.model.hf_token is not None and spec.model.hf_token.key == "token"
    assert spec.model.cache.claim_name == "model-cache"
    assert spec.runtime.args.schedule_policy == "lpm"
    assert spec.runtime.args.disable_radix_cache is True
    assert spec.runtime.image_pull_secrets == ({"name": "regcred"},)
    assert spec.runtime.env[1] == {
        "name": "POD_IP",
        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
    }
    assert spec.resources.cpu == "8"  # integer quantities become strings
    assert spec.resources.gpu_resource == "amd.com/gpu"
    assert spec.api_key is not None and spec.api_key.key == "token"
    assert spec.ingress is not None and spec.ingress.tls is not None
    assert spec.ingress.tls.secret_name == "chat-tls"
    assert spec.ingress.path == "/" and spec.ingress.path_type == "Prefix"
    assert dict(spec.scheduling.node_selector) == {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"
    }
    assert spec.scheduling.tolerations[0]["operator"] == "Exists"


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("hf://Qwen/Qwen2.5-0.5B-Instruct", {"hf_repo": "Qwen/Qwen2.5-0.5B-Instruct"}),
        (
            "hf://bartowski/Llama-3.2-1B-Instruct-GGUF/sub/Llama-3.2-1B-Q4_K_M.gguf",
            {
                "hf_repo": "bartowski/Llama-3.2-1B-Instruct-GGUF",
                "hf_file": "sub/Llama-3.2-1B-Q4_K_M.gguf",
            },
        ),
        ("pvc://models/llama/8b/", {"claim_name": "models", "claim_path": "llama/8b"}),
        ("pvc://models", {"claim_name": "models", "claim_path": ""}),
        ("file:///opt/models/smollm2", {"local_path": "/opt/models/smollm2"}),
    ],
)
def test_model_sources(uri: str, expected: dict[str, str]) -> None:
    model = parse({"model": {"uri": uri}}).spec.model
    assert model.source == uri.split("://")[0]
    for attr, value in expected.items():
        assert getattr(model, attr) == value


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"model": {"uri": "s3://bucket/model"}}, "spec.model.uri: 's3://bucket/model' is not"),
        ({"model": {"uri": "hf://just-a-name"}}, "spec.model.uri"),
        ({"model": {"uri": "file://relative/path"}}, "spec.model.uri"),
        ({"model": {"uri": "builtin://gpt-5"}}, "unknown builtin model 'gpt-5'"),
        ({"model": {"uri": "pvc://models/../etc"}}, "may not contain '..'"),
        ({"model": {"revision": "main"}}, "spec.model.revision: applies to hf:// models only"),
        (
            {"model": {"uri": "pvc://m", "cache": {"sizeLimit": "1Gi"}}},
            "spec.model.cache: applies to hf:// models only",
        ),
        (
            {"model": {"uri": "hf://a/b", "cache": {"claimName": "c", "sizeLimit": "1Gi"}}},
            "either claimName",
        ),
        ({"model": {"sizeGiB": 0}}, "spec.model.sizeGiB: must be greater than 0"),
        ({"replicas": -1}, "spec.replicas: must be at least 0, got -1"),
        ({"replicas": 65}, "spec.replicas: must be at most 64"),
        ({"replicas": "3"}, "spec.replicas: must be an integer, got '3'"),
        ({"replicas": True}, "spec.replicas: must be an integer"),
        (
            {"parallelism": {"tensor": 4}, "resources": {"gpus": 2}},
            "2 GPUs cannot hold parallelism.tensor=4",
        ),
        ({"runtime": {"extraArgs": ["--tp-size", "2"]}}, "--tp-size is set by the operator"),
        ({"resources": {"gpus": 1, "memory": "lots"}}, "'lots' is not a quantity"),
        ({"runtime": {"args": {"dtype": "int4"}}}, "spec.runtime.args.dtype: 'int4' is not one of"),
        ({"runtime": {"args": {"device": "cuda"}}}, "cuda needs GPUs"),
        ({"runtime": {"args": {"maxRunningRequests": 0}}}, "must be at least 1"),
        ({"runtime": {"extraArgs": ["--port", "9000"]}}, "--port is set by the operator"),
        ({"runtime": {"extraArgs": ["--dp-rank=2"]}}, "--dp-rank is set by the operator"),
        # argparse accepts unique prefixes: --mod would be --model
        (
            {"runtime": {"extraArgs": ["--mod", "x"]}},
            "--mod (read as --model) is set by the operator",
        ),
        ({"runtime": {"extraArgs": [3]}}, "spec.runtime.extraArgs[0]: must be a string"),
        ({"runtime": {"env": [{"name": "BERTH_API_KEY", "value": "x"}]}}, "set by the operator"),
        (
            {"runtime": {"env": [{"name": "BERTH_ADMIN_API_KEY", "value": "x"}]}},
            "set by the operator",
        ),
        (
            {"runtime": {"extraArgs": ["--admin-api-key-file", "/k"]}},
            "--admin-api-key-file is set by the operator",
        ),
        (
            {"runtime": {"extraArgs": ["--api-key=k"]}},
            "--api-key is set by the operator",
        ),
        ({"runtime": {"env": [{"value": "x"}]}}, "spec.runtime.env[0].name: required"),
        (
            {"runtime": {"env": [{"name": "HF_HUB_OFFLINE", "value": "0"}]}},
            "spec.runtime.env[0].name: HF_HUB_OFFLINE is set by the operator",
        ),
        (
            {"runtime": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}},
            "spec.runtime.env[1].name: duplicate entry 'A'",
        ),
        (
            {"runtime": {"imagePullSecrets": [{"name": "r"}, {"name": "r"}]}},
            "spec.runtime.imagePullSecrets[1].name: duplicate entry 'r'",
        ),
        (
            {"scheduling": {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "z"}]}},
            "spec.scheduling.topologySpreadConstraints[0].whenUnsatisfiable: required",
        ),
        (
            {
                "scheduling": {
                    "topologySpreadConstraints": [
                        {"maxSkew": 1, "topologyKey": "z", "whenUnsatisfiable": "ScheduleAnyway"},
                        {"maxSkew": 2, "topologyKey": "z", "whenUnsatisfiable": "ScheduleAnyway"},
                    ]
                }
            },
            "topologySpreadConstraints[1].topologyKey: duplicate entry for 'z' and ScheduleAnyway",
        ),
        (
            {"runtime": {"env": [{"name": "A", "value": "x", "valueFrom": {}}]}},
            "either value or valueFrom",
        ),
        (
            {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
            "minReplicas (5) must not exceed maxReplicas (2)",
        ),
        ({"autoscaling": {"tokenUsageCeiling": 1.5}}, "must be at most 1"),
        ({"routing": {"policy": "random"}}, "spec.routing.policy: 'random' is not one of"),
        ({"ingress": {"tls": {"secretName": "x"}}}, "spec.ingress.tls: needs ingress.host"),
        ({"ingress": {"tls": {}}}, "spec.ingress.tls.secretName: required"),
        ({"ingress": {"path": "v1"}}, "spec.ingress.path: 'v1' is not an absolute URL path"),
        ({"apiKeySecretRef": {"key": "k"}}, "spec.apiKeySecretRef.name: required"),
        ({"scheduling": {"nodeSelector": {"gpu": True}}}, "values must be strings"),
        ({"scheduling": {"tolerations": [{"effect": "Sometimes"}]}}, "'Sometimes' is not one of"),
        ({"replcas": 2}, "spec.replcas: unknown field"),
        ({"model": {"url": "hf://a/b"}}, "spec.model.url: unknown field"),
        ({"model": "hf://a/b"}, "spec.model: must be an object"),
    ],
)
def test_invalid_specs_name_the_field_and_the_fix(spec: dict[str, Any], expected: str) -> None:
    found = problems(spec)
    assert any(expected in p for p in found), found


def test_every_problem_is_reported_at_once() -> None:
    found = problems({"replicas": -1, "routing": {"policy": "x"}, "bogus": 1})
    assert len(found) == 3
    assert "spec.bogus: unknown field" in " ".join(found)


def test_unknown_field_message_lists_the_known_fields() -> None:
    (found,) = problems({"replcas": 2})
    assert "replicas" in found and "apiKeySecretRef" in found and "ingress" in found


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("a" * 46, "at most 45"),
        ("1chat", "must be lowercase letters"),
        ("chat.v2", "must be lowercase letters"),
        ("Chat", "must be lowercase letters"),
        ("", "metadata.name: required"),
    ],
)
def test_resource_name_must_fit_child_names(name: str, expected: str) -> None:
    found = problems({}, name=name)
    assert any(expected in p for p in found), found


def test_longest_name_is_accepted() -> None:
    assert parse({}, name="a" * 45).name == "a" * 45


def test_wrong_kind_or_api_version_is_refused() -> None:
    body = isvc_body({})
    body["apiVersion"] = "serving.kserve.io/v1beta1"
    with pytest.raises(SpecError, match="apiVersion: expected serving.berth.dev/v1alpha1"):
        InferenceService.from_body(body)


def test_namespace_defaults_to_default() -> None:
    body = isvc_body({})
    del body["metadata"]["namespace"]
    assert InferenceService.from_body(body).namespace == "default"


@pytest.mark.parametrize(
    ("replicas", "minimum", "maximum", "ranks"),
    [(1, 2, 6, 2), (4, 2, 6, 4), (9, 2, 6, 6), (0, 1, 3, 1)],
)
def test_autoscaling_keeps_ranks_within_bounds(
    replicas: int, minimum: int, maximum: int, ranks: int
) -> None:
    spec = parse(
        {
            "replicas": replicas,
            "autoscaling": {"enabled": True, "minReplicas": minimum, "maxReplicas": maximum},
        }
    ).spec
    assert spec.ranks == ranks
    # Disabled, replicas rule as written.
    off = parse({"replicas": replicas, "autoscaling": {"minReplicas": minimum}}).spec
    assert off.ranks == replicas


def test_quantities_accept_integers_and_strings() -> None:
    res = parse({"resources": {"cpu": 4, "memory": "16Gi", "cpuLimit": "500m"}}).spec.resources
    assert (res.cpu, res.memory, res.cpu_limit) == ("4", "16Gi", "500m")
