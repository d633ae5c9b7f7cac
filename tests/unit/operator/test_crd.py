"""The CRD: generated from the spec classes, structural, documented, its defaults, enums and CEL
rules in agreement with the parser and the runtime.

crds/ must be what `make crds` writes. Kubernetes would check the schema and run the CEL rules at
admission; no API server runs here, so the samples are validated with jsonschema against the CRD's
own openAPIV3Schema (after applying its defaults, with unknown fields refused so that nothing a
sample says would be pruned) and the CEL rules are evaluated with cel-python.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from berth_operator import constants as c
from berth_operator import crd as crd_module
from berth_operator.spec import InferenceServiceSpec, SpecError
from berth_operator.spec.runtime import DEVICES, DTYPES, LOG_LEVELS, SCHEDULE_POLICIES
from berth_runtime.server_args import ServerArgs

from .factories import (
    CEL,
    CRD_PATH,
    FULL_SPEC,
    SAMPLES,
    SCHEMA,
    SPEC_MATRIX,
    apply_schema_defaults,
    cel_failures,
    closed,
    crd,
    isvc_body,
    load_yaml_docs,
    validate_against_crd,
    walk,
)

SPEC_SCHEMA = SCHEMA["properties"]["spec"]


# --- the CRD itself --------------------------------------------------------------------------


def test_crds_folder_is_what_make_crds_writes() -> None:
    assert crd_module.stale(CRD_PATH.parent) == [], "crds/ is stale: run `make crds`"


def test_make_crds_writes_checks_and_clears_the_folder(tmp_path: Path) -> None:
    assert crd_module.main([str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(crd_module.files())
    assert crd_module.main([str(tmp_path), "--check"]) == 0
    crd_file = tmp_path / crd_module.CRD_FILE
    crd_file.write_text(crd_file.read_text().replace("maxLength: 512", "maxLength: 513", 1))
    (tmp_path / "old_kind.yaml").write_text("kind: Left\n")
    assert crd_module.stale(tmp_path) == [
        "old_kind.yaml is left over",
        f"{crd_module.CRD_FILE} is out of date",
    ]
    assert crd_module.main([str(tmp_path), "--check"]) == 1
    assert crd_module.main([str(tmp_path)]) == 0
    assert crd_module.stale(tmp_path) == []


def test_names_group_version_and_our_own_short_name() -> None:
    doc = crd()
    assert doc["metadata"]["name"] == f"{c.PLURAL}.{c.GROUP}"
    names = doc["spec"]["names"]
    assert (names["kind"], names["plural"], names["singular"]) == (c.KIND, c.PLURAL, c.SINGULAR)
    assert names["shortNames"] == list(c.SHORT_NAMES)
    assert "isvc" not in names["shortNames"]
    (version,) = doc["spec"]["versions"]
    assert version["name"] == c.VERSION and version["served"] and version["storage"]


def test_status_and_scale_subresources_point_at_real_fields() -> None:
    (version,) = crd()["spec"]["versions"]
    sub = version["subresources"]
    assert sub["status"] == {}
    scale = sub["scale"]
    assert scale == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    props = SCHEMA["properties"]
    assert props["spec"]["properties"]["replicas"]["type"] == "integer"
    assert props["status"]["properties"]["replicas"]["type"] == "integer"
    assert props["status"]["properties"]["selector"]["type"] == "string"


def test_printer_columns_show_ready_ranks_url_load_and_age() -> None:
    (version,) = crd()["spec"]["versions"]
    columns = {col["name"]: col for col in version["additionalPrinterColumns"]}
    assert {"Ready", "Ranks", "URL", "Queued", "Age"} <= set(columns)
    status_props = SCHEMA["properties"]["status"]["properties"]
    for col in columns.values():
        path = col["jsonPath"]
        if path.startswith(".status.") and "[" not in path:
            field = path.split(".")[2]
            assert field in status_props, f"{col['name']} reads unknown status field {field}"
            expected = {"integer": "integer", "string": "string"}[status_props[field]["type"]]
            assert col["type"] == expected
    assert columns["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'


def test_schema_is_structural_and_every_field_is_described() -> None:
    for path, node in walk(SCHEMA):
        if path in ("", ".metadata"):
            continue
        assert path.endswith("{}") or node.get("description"), (
            f"{path} has no description (kubectl explain)"
        )
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        else:
            assert node.get("type") in {
                "object",
                "array",
                "string",
                "integer",
                "number",
                "boolean",
            }, path
        if node.get("x-kubernetes-preserve-unknown-fields"):
            assert node["type"] == "object", path


def test_defaults_and_enums_are_valid_for_their_own_schema() -> None:
    for path, node in walk(SCHEMA):
        if "default" in node:
            jsonschema.Draft4Validator(closed(node)).validate(node["default"])
        for value in node.get("enum", []):
            jsonschema.Draft4Validator({"type": node["type"]}).validate(value)
            assert isinstance(value, str), path


def test_conditions_are_a_map_list_keyed_by_type() -> None:
    conds = SCHEMA["properties"]["status"]["properties"]["conditions"]
    assert conds["x-kubernetes-list-type"] == "map"
    assert conds["x-kubernetes-list-map-keys"] == ["type"]
    props = conds["items"]["properties"]
    assert {
        "type",
        "status",
        "reason",
        "message",
        "observedGeneration",
        "lastTransitionTime",
    } <= set(props)


def test_every_cel_rule_compiles() -> None:
    rules = [r for _, node in walk(SCHEMA) for r in node.get("x-kubernetes-validations") or []]
    assert len(rules) >= 10
    for rule in rules:
        CEL.compile(rule["rule"])
        assert rule["message"]


# --- agreement with the parser and the runtime ------------------------------------------------


@pytest.mark.parametrize("case", sorted(SPEC_MATRIX))
def test_crd_defaults_are_the_parsers_defaults(case: str) -> None:
    raw = SPEC_MATRIX[case]
    defaulted = apply_schema_defaults(SPEC_SCHEMA, raw)
    assert InferenceServiceSpec.from_spec(defaulted) == InferenceServiceSpec.from_spec(raw)


def test_secret_key_defaults_agree() -> None:
    raw = {
        "apiKeySecretRef": {"name": "k"},
        "model": {"uri": "hf://a/b", "hfTokenSecretRef": {"name": "t"}},
    }
    defaulted = apply_schema_defaults(SPEC_SCHEMA, raw)
    assert defaulted["apiKeySecretRef"]["key"] == "api-key"
    assert InferenceServiceSpec.from_spec(defaulted) == InferenceServiceSpec.from_spec(raw)


def literal_choices(field: str) -> list[str]:
    hints = typing.get_type_hints(ServerArgs)
    return list(typing.get_args(hints[field]))


@pytest.mark.parametrize(
    ("crd_field", "server_field", "parser_choices"),
    [
        ("dtype", "dtype", DTYPES),
        ("device", "device", DEVICES),
        ("schedulePolicy", "schedule_policy", SCHEDULE_POLICIES),
        ("logLevel", "log_level", LOG_LEVELS),
    ],
)
def test_runtime_arg_enums_match_the_runtime(
    crd_field: str, server_field: str, parser_choices: tuple[str, ...]
) -> None:
    args = SPEC_SCHEMA["properties"]["runtime"]["properties"]["args"]["properties"]
    assert args[crd_field]["enum"] == literal_choices(server_field) == list(parser_choices)


# --- samples ---------------------------------------------------------------------------------


def test_there_is_a_cpu_and_a_gpu_sample() -> None:
    docs = {p.name: load_yaml_docs(p)[0] for p in SAMPLES}
    cpu = docs["serving_v1alpha1_inferenceservice_cpu.yaml"]
    gpu = docs["serving_v1alpha1_inferenceservice_gpu.yaml"]
    assert cpu["spec"]["model"]["uri"].startswith("builtin://")
    assert cpu["spec"].get("resources", {}).get("gpus", 0) == 0
    assert gpu["spec"]["model"]["uri"].startswith("hf://meta-llama/")
    assert gpu["spec"]["resources"]["gpus"] == 1


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_samples_are_valid_for_the_crd_its_cel_rules_and_the_parser(path: Any) -> None:
    for doc in load_yaml_docs(path):
        validate_against_crd(doc)
        assert cel_failures(doc) == []
        InferenceServiceSpec.from_spec(doc["spec"])


def test_full_spec_is_valid_for_the_crd() -> None:
    validate_against_crd(isvc_body(FULL_SPEC))
    assert cel_failures(isvc_body(FULL_SPEC)) == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (isvc_body({}, name="a" * 46), "at most 45 characters"),
        (isvc_body({}, name="9lives"), "must start with a letter"),
        (
            isvc_body({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}),
            "minReplicas must not exceed",
        ),
        (
            isvc_body({"autoscaling": {"minReplicas": 5}}),
            "minReplicas must not exceed",
        ),  # max defaults to 4
        (
            isvc_body({"resources": {"gpus": 1}, "parallelism": {"tensor": 2}}),
            "at least parallelism.tensor",
        ),
        (isvc_body({"runtime": {"args": {"device": "cuda"}}}), "device cuda needs resources.gpus"),
        (
            isvc_body({"model": {"uri": "builtin://other"}}),
            "embeds builtin://smollm2-135m-instruct only",
        ),
        (isvc_body({"model": {"revision": "main"}}), "revision applies to hf://"),
        (
            isvc_body({"model": {"uri": "pvc://x", "hfTokenSecretRef": {"name": "t"}}}),
            "hfTokenSecretRef applies",
        ),
        (
            isvc_body({"model": {"uri": "file:///m", "cache": {"sizeLimit": "1Gi"}}}),
            "cache applies",
        ),
        (
            isvc_body(
                {"model": {"uri": "hf://a/b", "cache": {"claimName": "c", "sizeLimit": "1Gi"}}}
            ),
            "either cache.claimName or cache.sizeLimit",
        ),
        (isvc_body({"ingress": {"tls": {"secretName": "s"}}}), "ingress.tls needs ingress.host"),
        (
            isvc_body({"runtime": {"env": [{"name": "A", "value": "1", "valueFrom": {}}]}}),
            "value or valueFrom",
        ),
        (
            isvc_body({"runtime": {"env": [{"name": "BERTH_DP_RANK", "value": "1"}]}}),
            "set by the operator",
        ),
        (
            isvc_body({"runtime": {"env": [{"name": "HOME", "value": "/root"}]}}),
            "set by the operator",
        ),
    ],
)
def test_cel_rules_reject_what_the_parser_rejects(body: dict[str, Any], message: str) -> None:
    validate_against_crd(body)  # the shape is fine: only a cross-field rule catches it
    failures = cel_failures(body)
    assert any(message in f for f in failures), failures
    with pytest.raises(SpecError):
        from berth_operator.spec import InferenceService

        InferenceService.from_body(body)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"replicas": -1}, "replicas"),
        ({"replicas": 65}, "replicas"),
        ({"model": {"uri": "s3://b/m"}}, "uri"),
        ({"routing": {"policy": "random"}}, "policy"),
        ({"resources": {"memory": "lots"}}, "memory"),
        ({"runtime": {"args": {"dtype": "int4"}}}, "dtype"),
        ({"autoscaling": {"tokenUsageCeiling": 0}}, "tokenUsageCeiling"),
        ({"replcas": 2}, "replcas"),
    ],
)
def test_schema_rejects_what_the_parser_rejects(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(jsonschema.ValidationError) as info:
        validate_against_crd(isvc_body(spec))
    assert field in str(info.value.message) + "/".join(map(str, info.value.path))
    with pytest.raises(SpecError):
        InferenceServiceSpec.from_spec(spec)


@pytest.mark.parametrize(
    "spec",
    [
        {"runtime": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}},
        {"runtime": {"imagePullSecrets": [{"name": "r"}, {"name": "r"}]}},
        {
            "scheduling": {
                "topologySpreadConstraints": [
                    {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"},
                    {"maxSkew": 2, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"},
                ]
            }
        },
    ],
    ids=["env", "imagePullSecrets", "topologySpreadConstraints"],
)
def test_keyed_lists_refuse_duplicate_keys_like_the_parser(spec: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError, match="Duplicate value"):
        validate_against_crd(isvc_body(spec))
    with pytest.raises(SpecError, match="duplicate entry"):
        InferenceServiceSpec.from_spec(spec)


def test_every_list_of_keyed_items_is_a_map_list_with_required_keys() -> None:
    props = SPEC_SCHEMA["properties"]
    lists = {
        "env": props["runtime"]["properties"]["env"],
        "imagePullSecrets": props["runtime"]["properties"]["imagePullSecrets"],
        "topologySpreadConstraints": props["scheduling"]["properties"]["topologySpreadConstraints"],
    }
    for name, node in lists.items():
        assert node["x-kubernetes-list-type"] == "map", name
        # The API server accepts a map list only if its keys are required (or defaulted).
        assert set(node["x-kubernetes-list-map-keys"]) <= set(node["items"]["required"]), name
