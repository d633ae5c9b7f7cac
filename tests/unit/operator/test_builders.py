"""Every builder: the manifests' content, the runtime contract, and Kubernetes' own schemas."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import pytest

from berth_operator import builders, naming
from berth_operator import constants as c
from berth_operator.builders import network, rank_pods, rank_services, router
from berth_operator.plan import RankPlan, rank_urls
from berth_operator.spec import InferenceService
from berth_operator.spec.runtime import MANAGED_ENV, SET_ENV
from berth_router.args import RouterArgs
from berth_router.discovery import parse_selector, selector_matches
from berth_router.server import build_parser as build_router_parser
from berth_runtime.server_args import ServerArgs

from .factories import FULL_SPEC, K8S_VERSIONS, SPEC_MATRIX, parse, validate_strict


def by_kind(children: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in children if o["kind"] == kind]


def one(children: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in children if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def rank_container(isvc: InferenceService) -> dict[str, Any]:
    pod = rank_pods.build_rank_statefulset(isvc)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return container


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in container["env"]}


def with_local_keys(args: list[str]) -> list[str]:
    """Key files exist only in the pod: point their flags at local files of the same names."""
    local = Path(tempfile.gettempdir()) / "berth-test-keys"
    local.mkdir(exist_ok=True)
    rendered = []
    for arg in args:
        if arg.startswith(f"{c.KEYS_MOUNT}/"):
            name = arg.rsplit("/", 1)[1]
            (local / name).write_text(f"key-from-{name}\n")
            arg = str(local / name)
        rendered.append(arg)
    return rendered


def parse_server_args(args: list[str]) -> ServerArgs:
    """Parse rendered `berth serve` args the way the runtime does, with the rank substituted."""
    assert args[0] == "serve"
    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    rendered = [a.replace(f"$({c.ENV_DP_RANK})", "2") for a in with_local_keys(args[1:])]
    return ServerArgs.from_cli_args(parser.parse_args(rendered))


# --- children as a whole ---------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(SPEC_MATRIX))
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_child_is_valid_for_kubernetes_in_strict_mode(case: str, version: str) -> None:
    for child in builders.build_children(parse(SPEC_MATRIX[case])):
        validate_strict(child, version)


def test_children_of_the_full_spec() -> None:
    children = builders.build_children(parse(FULL_SPEC))
    names = [(o["kind"], o["metadata"]["name"]) for o in children]
    assert names == [
        ("Service", "chat-ranks"),
        ("StatefulSet", "chat"),
        ("Service", "chat-rank-0"),
        ("Service", "chat-rank-1"),
        ("Service", "chat-rank-2"),
        ("PodDisruptionBudget", "chat"),
        ("ServiceAccount", "chat-router"),
        ("RoleBinding", "chat-router"),
        ("Deployment", "chat-router"),
        ("PodDisruptionBudget", "chat-router"),
        ("Service", "chat"),
        ("Ingress", "chat"),
    ]


def test_every_child_is_owned_labelled_and_namespaced() -> None:
    isvc = parse(FULL_SPEC)
    for child in builders.build_children(isvc):
        meta = child["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "serving.berth.dev/v1alpha1",
                "kind": "InferenceService",
                "name": "chat",
                "uid": isvc.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        labels = meta["labels"]
        for key, value in naming.owned_labels("chat").items():
            assert labels[key] == value
        assert labels["app.kubernetes.io/name"] == "berth"
        # Argo CD's default tracking label: on a child it reads as "prune me".
        assert "app.kubernetes.io/instance" not in labels
    for pod_template in (
        child["spec"]["template"]["metadata"]["labels"]
        for child in builders.build_children(isvc)
        if child["kind"] in ("StatefulSet", "Deployment")
    ):
        assert "app.kubernetes.io/instance" not in pod_template


def test_without_uid_children_have_no_owner_reference() -> None:
    for child in builders.build_children(parse({}, uid=None)):
        assert "ownerReferences" not in child["metadata"]


def test_builders_are_deterministic() -> None:
    assert builders.build_children(parse(FULL_SPEC)) == builders.build_children(parse(FULL_SPEC))


def test_minimal_spec_has_no_ingress_and_one_rank_service() -> None:
    children = builders.build_children(parse({}))
    assert not by_kind(children, "Ingress")
    assert [s["metadata"]["name"] for s in by_kind(children, "Service")] == [
        "chat-ranks",
        "chat-rank-0",
        "chat",
    ]


# --- rank StatefulSet ------------------------------------------------------------------------


def test_statefulset_selector_matches_its_pods_and_is_stable() -> None:
    sts = rank_pods.build_rank_statefulset(parse(FULL_SPEC))
    selector = sts["spec"]["selector"]["matchLabels"]
    template_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= template_labels.items()
    # The selector is immutable in Kubernetes: it must not depend on anything but the name.
    assert (
        selector == rank_pods.build_rank_statefulset(parse({}))["spec"]["selector"]["matchLabels"]
    )
    assert sts["spec"]["serviceName"] == "chat-ranks"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert template_labels[c.LABEL_ENGINE_TYPE] == "sglang"


def test_replicas_are_the_ranks() -> None:
    isvc = parse({"replicas": 3, "autoscaling": {"enabled": True, "maxReplicas": 2}})
    assert rank_pods.build_rank_statefulset(isvc)["spec"]["replicas"] == 2
    assert len(rank_services.build_rank_services(isvc)) == 2


def test_rank_comes_from_the_pod_index_label_and_is_passed_as_an_expanded_variable() -> None:
    container = rank_container(parse({}))
    env = env_of(container)
    assert env[c.ENV_DP_RANK]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}
    }
    args = container["args"]
    assert args[args.index("--dp-rank") + 1] == "$(BERTH_DP_RANK)"


@pytest.mark.parametrize("case", sorted(SPEC_MATRIX))
def test_rendered_args_parse_with_the_runtimes_server_args(case: str) -> None:
    isvc = parse(SPEC_MATRIX[case])
    container = rank_container(isvc)
    assert container["command"] == ["berth"]
    server = parse_server_args(container["args"])
    assert server.host == "0.0.0.0"
    assert server.port == c.HTTP_PORT
    assert server.dp_rank == 2
    assert server.model_cache_dir == c.CACHE_MOUNT
    assert server.graceful_shutdown_timeout == isvc.spec.runtime.graceful_shutdown_seconds
    assert "--api-key" not in container["args"]  # never an argument, only a file


def test_full_spec_args_reach_the_runtime_unchanged() -> None:
    server = parse_server_args(rank_container(parse(FULL_SPEC))["args"])
    assert server.model == "/mnt/models/hf/meta-llama--Llama-3.1-8B-Instruct@v1.0"
    assert server.served_model_name == "llama"
    assert server.dtype == "bfloat16"
    assert server.device == "cuda"
    assert server.context_length == 8192
    assert server.max_running_requests == 128
    assert server.max_total_tokens == 200000
    assert server.max_prefill_tokens == 8192
    assert server.chunked_prefill_size == 1024
    assert server.max_queued_requests == 512
    assert server.schedule_policy == "lpm"
    assert server.disable_radix_cache is True
    assert server.log_level == "debug"
    assert server.grammar_backend == "xgrammar"
    assert server.tool_call_parser == "hermes"
    assert server.reasoning_parser == "qwen3"
    assert server.graceful_shutdown_timeout == 120
    assert server.random_seed == 7  # from extraArgs
    assert server.tp_size == 1


def test_builtin_model_passes_no_model_flag() -> None:
    args = rank_container(parse({}))["args"]
    assert "--model" not in args and "--served-model-name" not in args
    assert parse_server_args(args).model == "builtin://smollm2-135m-instruct"


@pytest.mark.parametrize(
    ("uri", "model", "served"),
    [
        (
            "hf://Qwen/Qwen2.5-0.5B-Instruct",
            "/mnt/models/hf/Qwen--Qwen2.5-0.5B-Instruct@main",
            "Qwen/Qwen2.5-0.5B-Instruct",
        ),
        (
            "hf://org/repo-GGUF/q4.gguf",
            "/mnt/models/hf/org--repo-GGUF@main/q4.gguf",
            "org/repo-GGUF",
        ),
        ("pvc://models/llama/8b", "/mnt/models/llama/8b", None),
        ("pvc://models", "/mnt/models", None),
        ("file:///opt/model.gguf", "/opt/model.gguf", None),
    ],
)
def test_model_path_per_source(uri: str, model: str, served: str | None) -> None:
    server = parse_server_args(rank_container(parse({"model": {"uri": uri}}))["args"])
    assert server.model == model
    assert server.served_model_name == served


def test_keys_come_from_their_secrets_as_files_never_as_arguments_or_env() -> None:
    isvc = parse(
        {"apiKeySecretRef": {"name": "chat-key"}, "adminApiKeySecretRef": {"name": "ops-key"}}
    )
    rank_pod = rank_pods.build_rank_statefulset(isvc)["spec"]["template"]["spec"]
    router_pod = router.build_router_deployment(isvc)["spec"]["template"]["spec"]
    for pod in (rank_pod, router_pod):
        (container,) = pod["containers"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["api-keys"]["projected"]["sources"] == [
            {"secret": {"name": "chat-key", "items": [{"key": "api-key", "path": "api-key"}]}},
            {
                "secret": {
                    "name": "ops-key",
                    "items": [{"key": "admin-api-key", "path": "admin-api-key"}],
                }
            },
        ]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "api-keys")
        assert mount == {"name": "api-keys", "mountPath": c.KEYS_MOUNT, "readOnly": True}
        names = {e["name"] for e in container.get("env", [])}
        assert not names & {c.ENV_API_KEY, c.ENV_ADMIN_API_KEY}  # never from the environment
    # The flags name the mounted files, and the runtime and the router read each key from its
    # own file (here local copies of the same names).
    for args in (
        parse_server_args(rank_pod["containers"][0]["args"]),
        router_args_of(router.build_router_deployment(isvc)),
    ):
        assert args.api_key_file.endswith("/api-key")
        assert args.admin_api_key_file.endswith("/admin-api-key")
        assert (args.api_key, args.admin_api_key) == ("key-from-api-key", "key-from-admin-api-key")
    assert f"{c.KEYS_MOUNT}/api-key" in rank_pod["containers"][0]["args"]
    assert f"{c.KEYS_MOUNT}/admin-api-key" in router_pod["containers"][0]["args"]
    # Only the serving key: one file; no key: no volume, no flag.
    only = rank_pods.build_rank_statefulset(parse({"apiKeySecretRef": {"name": "k"}}))
    assert only["spec"]["template"]["spec"]["volumes"][-1]["projected"]["sources"] == [
        {"secret": {"name": "k", "items": [{"key": "api-key", "path": "api-key"}]}}
    ]
    bare = rank_pods.build_rank_statefulset(parse({}))["spec"]["template"]["spec"]
    assert "api-keys" not in {v["name"] for v in bare["volumes"]}
    assert not any("key" in a for a in bare["containers"][0]["args"])


def test_gpu_limits_shared_memory_and_memory_limit() -> None:
    isvc = parse(FULL_SPEC)
    res = rank_container(isvc)["resources"]
    assert res["limits"]["amd.com/gpu"] == "2" and res["requests"]["amd.com/gpu"] == "2"
    assert res["requests"] == {"cpu": "8", "memory": "64Gi", "amd.com/gpu": "2"}
    assert res["limits"] == {"memory": "80Gi", "cpu": "16", "amd.com/gpu": "2"}
    pod = rank_pods.build_rank_statefulset(isvc)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    mounts = {m["name"]: m["mountPath"] for m in rank_container(isvc)["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm"


def test_cpu_rank_requests_no_gpu_and_memory_is_its_own_limit() -> None:
    res = rank_container(parse({"resources": {"memory": "3Gi"}}))["resources"]
    assert res == {"requests": {"cpu": "1", "memory": "3Gi"}, "limits": {"memory": "3Gi"}}


def test_pods_are_non_root_with_a_read_only_root_filesystem() -> None:
    for child in builders.build_children(parse(FULL_SPEC)):
        if child["kind"] not in ("StatefulSet", "Deployment"):
            continue
        pod = child["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == c.RUN_AS_UID
        # Only the router talks to the API server (discovery), with its own account.
        is_router = child["kind"] == "Deployment"
        assert pod["automountServiceAccountToken"] is is_router
        assert pod.get("serviceAccountName") == ("chat-router" if is_router else None)
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
            # Every path the processes write to is a volume.
            assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/tmp"}


def test_probes_use_health_and_the_startup_budget_grows_with_the_model() -> None:
    container = rank_container(parse({}))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
        assert container[probe]["timeoutSeconds"] >= 5

    def budget(spec: dict[str, Any]) -> int:
        probe = rank_container(parse(spec))["startupProbe"]
        return probe["periodSeconds"] * probe["failureThreshold"]

    builtin = budget({})
    small = budget({"model": {"uri": "hf://a/b", "sizeGiB": 1}})
    big = budget({"model": {"uri": "hf://a/b", "sizeGiB": 140}})
    big_pvc = budget({"model": {"uri": "pvc://m/x", "sizeGiB": 140}})
    assert builtin == small == 300  # the floor
    assert big > small and big >= 180 + 140 * 6
    assert big_pvc > big  # network volumes are read more slowly than a local download
    assert budget({"runtime": {"startupTimeoutSeconds": 3600}}) == 3600
    assert budget({"runtime": {"startupTimeoutSeconds": 3605}}) >= 3605


def test_graceful_drain_pre_stop_and_termination_grace() -> None:
    isvc = parse({"runtime": {"gracefulShutdownSeconds": 90, "preStopSleepSeconds": 12}})
    pod = rank_pods.build_rank_statefulset(isvc)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "12"]
    assert pod["terminationGracePeriodSeconds"] == 12 + 90 + rank_pods.TERMINATION_MARGIN_SECONDS
    assert parse_server_args(container["args"]).graceful_shutdown_timeout == 90
    router_pod = router.build_router_deployment(isvc)["spec"]["template"]["spec"]
    assert router_pod["terminationGracePeriodSeconds"] == pod["terminationGracePeriodSeconds"]


def test_hf_model_downloads_in_an_init_container_into_the_model_volume() -> None:
    isvc = parse(FULL_SPEC)
    pod = rank_pods.build_rank_statefulset(isvc)["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"][:3] == ["hf", "download", "meta-llama/Llama-3.1-8B-Instruct"]
    command = init["command"]
    assert command[command.index("--revision") + 1] == "v1.0"
    assert command[command.index("--local-dir") + 1] == rank_pods.hf_download_dir(isvc.spec)
    assert "original/*" in command  # Llama repos carry a second copy of the weights
    assert env_of(init)["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "hf-token",
        "key": "token",
    }
    assert "nvidia.com/gpu" not in str(init["resources"]) and "amd.com" not in str(init)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"] == {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "model-cache"},
    }
    init_mount = {m["name"]: m for m in init["volumeMounts"]}["model"]
    rank_mount = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}["model"]
    assert init_mount.get("readOnly") is not True and rank_mount["readOnly"] is True
    # The rank itself never reaches for the Hub.
    assert env_of(pod["containers"][0])["HF_HUB_OFFLINE"]["value"] == "1"


def test_hf_single_file_download_names_the_file_and_uses_an_empty_dir() -> None:
    isvc = parse({"model": {"uri": "hf://org/repo/q4.gguf", "cache": {"sizeLimit": "5Gi"}}})
    pod = rank_pods.build_rank_statefulset(isvc)["spec"]["template"]["spec"]
    command = pod["initContainers"][0]["command"]
    assert command[:4] == ["hf", "download", "org/repo", "q4.gguf"]
    assert "--exclude" not in command and "--revision" not in command
    assert {v["name"]: v for v in pod["volumes"]}["model"]["emptyDir"] == {"sizeLimit": "5Gi"}


def test_pvc_model_is_mounted_read_only_and_needs_no_init_container() -> None:
    pod = rank_pods.build_rank_statefulset(parse({"model": {"uri": "pvc://models/llama"}}))
    spec = pod["spec"]["template"]["spec"]
    assert "initContainers" not in spec
    assert {v["name"]: v for v in spec["volumes"]}["model"]["persistentVolumeClaim"] == {
        "claimName": "models",
        "readOnly": True,
    }


def test_builtin_and_file_models_mount_no_model_volume() -> None:
    for uri in ("builtin://smollm2-135m-instruct", "file:///models/x"):
        spec = rank_pods.build_rank_statefulset(parse({"model": {"uri": uri}}))["spec"]
        assert "model" not in {v["name"] for v in spec["template"]["spec"]["volumes"]}


def test_scheduling_fields_reach_the_rank_pods() -> None:
    pod = rank_pods.build_rank_statefulset(parse(FULL_SPEC))["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"] == FULL_SPEC["scheduling"]["tolerations"]
    assert pod["affinity"] == FULL_SPEC["scheduling"]["affinity"]
    assert pod["priorityClassName"] == "inference-high"
    assert pod["topologySpreadConstraints"] == FULL_SPEC["scheduling"]["topologySpreadConstraints"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    env = env_of(pod["containers"][0])
    assert env["NCCL_DEBUG"] == {"name": "NCCL_DEBUG", "value": "INFO"}


# --- Services, PDBs, router, Ingress -----------------------------------------------------------


def test_each_rank_service_selects_exactly_its_pod() -> None:
    isvc = parse({"replicas": 3})
    services = rank_services.build_rank_services(isvc)
    assert [s["metadata"]["name"] for s in services] == [
        "chat-rank-0",
        "chat-rank-1",
        "chat-rank-2",
    ]
    for rank, service in enumerate(services):
        # The pod's ordinal, which is its rank in whichever rank set (StatefulSet) it is.
        assert service["spec"]["selector"][c.POD_INDEX_LABEL] == str(rank)
        assert service["spec"]["ports"][0]["port"] == c.HTTP_PORT
        assert service["metadata"]["annotations"][f"{c.GROUP}/dp-rank"] == str(rank)
        assert service["metadata"]["labels"][c.LABEL_DP_RANK] == str(rank)


def test_headless_service_publishes_not_ready_ranks() -> None:
    svc = rank_services.build_headless_service(parse({}))
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True


def router_args_of(dep: dict[str, Any]) -> RouterArgs:
    """The rendered `berth router` flags, parsed by the router's own parser."""
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["berth"]
    args = container["args"]
    assert args[:1] == ["router"]
    return RouterArgs.from_cli_args(build_router_parser().parse_args(with_local_keys(args[1:])))


def test_router_gets_the_policy_and_discovers_exactly_the_rank_services() -> None:
    isvc = parse({"replicas": 3, "routing": {"policy": "roundRobin", "routerReplicas": 2}})
    dep = router.build_router_deployment(isvc)
    assert dep["spec"]["replicas"] == 2
    args = router_args_of(dep)
    assert args.policy == "round_robin"
    assert args.port == c.HTTP_PORT and args.host == "0.0.0.0"
    assert args.worker_urls == ()
    assert args.discover_namespace == "team-a"
    assert args.discover_rank_label == c.LABEL_DP_RANK
    # EndpointSlices carry their Service's labels: the selector must pick the per-rank Services
    # (and read their rank) but not the headless one, nor another InferenceService's.
    terms = parse_selector(args.discover_selector or "")
    ranks = rank_services.build_rank_services(isvc)
    assert all(selector_matches(terms, s["metadata"]["labels"]) for s in ranks)
    assert [int(s["metadata"]["labels"][args.discover_rank_label]) for s in ranks] == [0, 1, 2]
    assert args.discover_port_name == ranks[0]["spec"]["ports"][0]["name"]
    headless = rank_services.build_headless_service(isvc)
    assert not selector_matches(terms, headless["metadata"]["labels"])
    other = rank_services.build_rank_services(parse({"replicas": 1}, name="other"))[0]
    assert not selector_matches(terms, other["metadata"]["labels"])
    selector = dep["spec"]["selector"]["matchLabels"]
    assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert selector[c.LABEL_ROLE] == "router"
    probes = dep["spec"]["template"]["spec"]["containers"][0]
    assert probes["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert probes["livenessProbe"]["httpGet"]["path"] == "/liveness"


def test_the_router_runs_the_router_image_whatever_the_ranks_run() -> None:
    isvc = parse({"replicas": 2, "runtime": {"image": "team/model-baked:3"}})
    container = router.build_router_deployment(isvc)["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == c.DEFAULT_ROUTER_IMAGE != c.DEFAULT_RUNTIME_IMAGE
    assert container["command"] == ["berth"] and container["args"][0] == "router"


def test_scaling_does_not_change_the_router_so_it_is_not_restarted() -> None:
    one_rank = router.build_router_deployment(parse({"replicas": 1}))
    five_ranks = router.build_router_deployment(parse({"replicas": 5}))
    assert one_rank == five_ranks
    assert router.build_router_deployment(parse({"replicas": 0})) == one_rank


def test_router_account_is_bound_to_the_shipped_router_cluster_role_only() -> None:
    children = builders.build_children(parse({}))
    account = one(children, "ServiceAccount", "chat-router")
    assert account["automountServiceAccountToken"] is False  # the router pod opts in
    assert "Role" not in {o["kind"] for o in children}  # the rules ship in manifests/rbac/
    binding = one(children, "RoleBinding", "chat-router")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": c.ROUTER_CLUSTER_ROLE,
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "chat-router", "namespace": "team-a"}
    ]
    pod = one(children, "Deployment", "chat-router")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    without = builders.build_children(parse({"routing": {"routerReplicas": 0}}))
    assert not {"ServiceAccount", "RoleBinding"} & {o["kind"] for o in without}


def test_the_runtime_env_names_the_operator_sets_are_the_ones_users_may_not() -> None:
    spec = parse({"apiKeySecretRef": {"name": "k"}})
    sts = one(builders.build_children(spec), "StatefulSet", "chat")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert {e["name"] for e in container["env"]} == set(SET_ENV)
    # The key variables are never set, and no user may set them either.
    assert set(MANAGED_ENV) == {*SET_ENV, c.ENV_API_KEY, c.ENV_ADMIN_API_KEY}


def test_entry_service_points_at_the_router_or_at_the_ranks_without_one() -> None:
    with_router = network.build_entry_service(parse({}))
    assert with_router["spec"]["selector"][c.LABEL_ROLE] == "router"
    assert with_router["spec"]["ports"] == [
        {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}
    ]
    direct = network.build_entry_service(parse({"routing": {"routerReplicas": 0}}))
    assert direct["spec"]["selector"][c.LABEL_ROLE] == "rank"
    children = builders.build_children(parse({"routing": {"routerReplicas": 0}}))
    assert not by_kind(children, "Deployment")
    assert [p["metadata"]["name"] for p in by_kind(children, "PodDisruptionBudget")] == ["chat"]


def test_pdbs_allow_one_disruption_at_a_time() -> None:
    children = builders.build_children(parse(FULL_SPEC))
    for pdb in by_kind(children, "PodDisruptionBudget"):
        assert pdb["spec"]["maxUnavailable"] == 1
    rank_pdb = one(children, "PodDisruptionBudget", "chat")
    sts = one(children, "StatefulSet", "chat")
    assert rank_pdb["spec"]["selector"] == sts["spec"]["selector"]


def test_ingress_routes_to_the_entry_service_with_tls() -> None:
    ingress = network.build_ingress(parse(FULL_SPEC))
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [{"hosts": ["chat.example.com"], "secretName": "chat-tls"}]
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "chat.example.com"
    assert rule["http"]["paths"][0]["backend"] == {
        "service": {"name": "chat", "port": {"name": "http"}}
    }
    assert ingress["metadata"]["annotations"] == FULL_SPEC["ingress"]["annotations"]


def test_urls() -> None:
    full = parse(FULL_SPEC)
    assert naming.ingress_url(full) == "https://chat.example.com/v1"
    hostless = parse({"ingress": {}})
    assert naming.ingress_url(hostless) is None
    assert naming.ingress_url(hostless, "203.0.113.7") == "http://203.0.113.7/v1"
    assert naming.ingress_url(parse({})) is None
    assert naming.cluster_url(full) == "http://chat.team-a.svc/v1"
    wildcard = parse({"ingress": {"host": "*.example.com"}})
    assert naming.ingress_url(wildcard) is None


# --- the rank plan (autoscaler and health checks) ------------------------------------------------


def rank_service_names(children: list[dict[str, Any]]) -> list[str]:
    return [
        s["metadata"]["name"]
        for s in by_kind(children, "Service")
        if c.LABEL_DP_RANK in s["metadata"]["labels"]
    ]


def test_withdrawn_ranks_lose_their_service_but_keep_their_pods() -> None:
    isvc = parse({"replicas": 3})
    plan = RankPlan(3, frozenset({1}))
    children = builders.build_children(isvc, plan)
    assert rank_service_names(children) == ["chat-rank-0", "chat-rank-2"]
    assert one(children, "StatefulSet", "chat")["spec"]["replicas"] == 3
    # The router discovers ranks through those Services; rank_urls agrees.
    assert rank_urls(isvc, plan) == [
        "http://chat-rank-0.team-a.svc:8000",
        "http://chat-rank-2.team-a.svc:8000",
    ]
    # The headless Service (stable DNS, what the operator's own view relies on) stays.
    assert one(children, "Service", "chat-ranks")
    everyone = builders.build_children(isvc, RankPlan(3, frozenset({0, 1, 2})))
    assert rank_service_names(everyone) == []
    assert one(everyone, "StatefulSet", "chat")["spec"]["replicas"] == 3


def test_plan_pods_set_the_statefulset_replicas() -> None:
    isvc = parse({"replicas": 2, "autoscaling": {"enabled": True, "maxReplicas": 8}})
    children = builders.build_children(isvc, RankPlan(5, frozenset({4})))
    assert one(children, "StatefulSet", "chat")["spec"]["replicas"] == 5
    assert rank_service_names(children) == [f"chat-rank-{r}" for r in range(4)]
    shrunk = builders.build_children(isvc, RankPlan(1))
    assert one(shrunk, "StatefulSet", "chat")["spec"]["replicas"] == 1
    assert rank_service_names(shrunk) == ["chat-rank-0"]


def test_withdrawn_ranks_beyond_the_pods_are_ignored() -> None:
    assert RankPlan(2, frozenset({5})).routable == [0, 1]
    assert RankPlan(0).routable == []
    assert RankPlan(4, frozenset({0, 3})).routable == [1, 2]


def test_without_a_plan_the_spec_decides() -> None:
    for spec in (FULL_SPEC, {"replicas": 3}, {"replicas": 0}):
        isvc = parse(spec)
        assert RankPlan.of(isvc) == RankPlan(isvc.spec.ranks)
        assert builders.build_children(isvc) == builders.build_children(isvc, RankPlan.of(isvc))
        assert rank_urls(isvc) == rank_urls(isvc, RankPlan.of(isvc))
    clamped = parse({"replicas": 1, "autoscaling": {"enabled": True, "minReplicas": 2}})
    assert RankPlan.of(clamped) == RankPlan(2)


def test_a_plan_changes_nothing_but_the_rank_services_and_replicas() -> None:
    isvc = parse(FULL_SPEC)
    plain = {(o["kind"], o["metadata"]["name"]): o for o in builders.build_children(isvc)}
    planned = {
        (o["kind"], o["metadata"]["name"]): o
        for o in builders.build_children(isvc, RankPlan(5, frozenset({0, 4})))
    }
    keys = plain.keys() | planned.keys()
    rank_services = {key for key in keys if key[1].startswith("chat-rank-")}
    assert {k for k in planned if k in rank_services} == {
        ("Service", f"chat-rank-{r}") for r in (1, 2, 3)
    }
    sts = ("StatefulSet", "chat")
    assert planned[sts]["spec"]["replicas"] == 5
    assert {**planned[sts], "spec": {**planned[sts]["spec"], "replicas": 3}} == plain[sts]
    # In particular the router Deployment is untouched: withdrawing a rank never restarts it.
    others = keys - rank_services - {sts}
    assert all(plain.get(k) == planned.get(k) for k in others)
    assert ("Deployment", "chat-router") in others
    # A rank Service that stays is the very same object.
    assert planned[("Service", "chat-rank-1")] == plain[("Service", "chat-rank-1")]
