"""Pure functions from an InferenceService to the child manifests the operator applies.

No API calls and no clock here: the same input always gives the same dicts, so `berth operator
render` prints exactly what the operator applies, and a second reconcile is a no-op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from berth_operator import constants as c
from berth_operator.spec import InferenceService, InferenceServiceSpec

Manifest = dict[str, Any]

ROUTER_POLICY_FLAGS = {
    "cacheAware": "cache_aware",
    "leastLoad": "least_load",
    "roundRobin": "round_robin",
}

# Startup probe budget: a fixed part (process start, CUDA init, warm-up) plus the weight loading,
# which scales with the model's size and with where the weights are read from. A download (hf://)
# happens in an init container before the probe starts, so it never counts against this budget.
STARTUP_PROBE_PERIOD_SECONDS = 10
STARTUP_BASE_SECONDS = 180
STARTUP_MIN_SECONDS = 300
LOAD_SECONDS_PER_GIB = {"builtin": 0.0, "hf": 6.0, "file": 6.0, "pvc": 12.0}
DEFAULT_MODEL_SIZE_GIB = 16.0  # an 8B model in bf16, when model.sizeGiB is not given
# Termination: preStop sleep (endpoints drop the pod) + the runtime's drain + this margin.
TERMINATION_MARGIN_SECONDS = 15
ROUTER_PRE_STOP_SECONDS = 5
HF_DOWNLOAD_EXCLUDES = ("original/*", "*.pth", "*.pt", "*.bin", "*.msgpack", "*.h5", "*.onnx")


def rank_statefulset_name(name: str) -> str:
    return name


def headless_service_name(name: str) -> str:
    return f"{name}-ranks"


def rank_service_name(name: str, rank: int) -> str:
    return f"{name}-rank-{rank}"


def rank_pod_name(name: str, rank: int) -> str:
    return f"{name}-{rank}"


def router_name(name: str) -> str:
    """The router's Deployment, PodDisruptionBudget, ServiceAccount and RoleBinding."""
    return f"{name}-router"


def entry_service_name(name: str) -> str:
    return name


def selector_labels(name: str, role: str) -> dict[str, str]:
    """Labels that select one role's pods; they never change for the life of the resource."""
    return {c.LABEL_ISVC: name, c.LABEL_ROLE: role}


def owned_labels(name: str) -> dict[str, str]:
    """Labels on every child: what `prune` lists to find the children of one InferenceService."""
    return {c.LABEL_ISVC: name, c.LABEL_MANAGED_BY: c.MANAGED_BY}


def labels(name: str, role: str | None = None) -> dict[str, str]:
    """Every child's labels. No `app.kubernetes.io/instance`: GitOps tools read that one as
    ownership (Argo CD's default tracking label) and would prune the children."""
    result = {
        c.LABEL_NAME: c.APP_NAME,
        c.LABEL_PART_OF: c.APP_NAME,
        **owned_labels(name),
    }
    if role is not None:
        result[c.LABEL_COMPONENT] = role
        result[c.LABEL_ROLE] = role
    return result


def label_selector(selector: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


def service_url(isvc: InferenceService, service: str, port: int) -> str:
    return f"http://{service}.{isvc.namespace}.svc:{port}"


@dataclass(frozen=True)
class RankPlan:
    """How many rank pods run, and which of them the router must not send requests to.

    A withdrawn rank keeps its pod but loses its per-rank Service, so the router (which follows
    those Services' EndpointSlices) stops routing to it at once: a rank being drained before a
    scale-down, or one whose scheduler has stalled.
    """

    pods: int
    withdrawn: frozenset[int] = frozenset()

    @classmethod
    def of(cls, isvc: InferenceService) -> RankPlan:
        """The plan the spec alone implies: every rank it asks for, all of them routable."""
        return cls(isvc.spec.ranks)

    @property
    def routable(self) -> list[int]:
        return [rank for rank in range(self.pods) if rank not in self.withdrawn]


def rank_urls(isvc: InferenceService, plan: RankPlan | None = None) -> list[str]:
    plan = plan or RankPlan.of(isvc)
    return [
        service_url(isvc, rank_service_name(isvc.name, rank), c.HTTP_PORT) for rank in plan.routable
    ]


def rank_endpoints_selector(name: str) -> str:
    """Selects the EndpointSlices of the per-rank Services (not the headless one's): the
    EndpointSlice controller copies each Service's labels, the rank label included."""
    return f"{c.LABEL_ISVC}={name},{c.LABEL_DP_RANK}"


def cluster_url(isvc: InferenceService) -> str:
    """The in-cluster OpenAI base URL (the entry Service, port 80)."""
    return f"http://{entry_service_name(isvc.name)}.{isvc.namespace}.svc/v1"


def build_children(isvc: InferenceService, plan: RankPlan | None = None) -> list[Manifest]:
    """Every child of one InferenceService, in apply order (workloads before their pointers).

    `plan` overrides the spec's rank count and withdraws ranks from routing (the autoscaler's and
    the health checks' decisions); without it, the spec alone decides.
    """
    spec = isvc.spec
    plan = plan or RankPlan.of(isvc)
    children = [
        build_headless_service(isvc),
        build_rank_statefulset(isvc, plan),
        *build_rank_services(isvc, plan),
        build_rank_pdb(isvc),
    ]
    if spec.has_router:
        children += [
            build_router_service_account(isvc),
            build_router_role_binding(isvc),
            build_router_deployment(isvc),
            build_router_pdb(isvc),
        ]
    children.append(build_entry_service(isvc))
    if spec.ingress is not None:
        children.append(build_ingress(isvc))
    if isvc.uid:
        for child in children:
            child["metadata"]["ownerReferences"] = [owner_reference(isvc)]
    return children


def owner_reference(isvc: InferenceService) -> dict[str, Any]:
    # blockOwnerDeletion: foreground deletion of the InferenceService waits for its children.
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "name": isvc.name,
        "uid": isvc.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(isvc: InferenceService, name: str, role: str | None) -> dict[str, Any]:
    return {"name": name, "namespace": isvc.namespace, "labels": labels(isvc.name, role)}


# --- ranks -------------------------------------------------------------------------------------


def build_rank_statefulset(isvc: InferenceService, plan: RankPlan | None = None) -> Manifest:
    """One pod per DP rank; the ordinal is the rank, and a rank never surges onto a second GPU."""
    plan = plan or RankPlan.of(isvc)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(isvc, rank_statefulset_name(isvc.name), c.ROLE_RANK),
        "spec": {
            "serviceName": headless_service_name(isvc.name),
            "replicas": plan.pods,
            # Ranks load in parallel; rolling updates still replace one rank at a time.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector_labels(isvc.name, c.ROLE_RANK)},
            "template": {
                "metadata": {
                    "labels": {
                        **labels(isvc.name, c.ROLE_RANK),
                        c.LABEL_ENGINE_TYPE: c.ENGINE_TYPE,
                    },
                    "annotations": {
                        "kubectl.kubernetes.io/default-container": "runtime",
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(c.HTTP_PORT),
                        "prometheus.io/path": c.METRICS_PATH,
                    },
                },
                "spec": _rank_pod_spec(isvc),
            },
        },
    }


def _rank_pod_spec(isvc: InferenceService) -> dict[str, Any]:
    spec = isvc.spec
    runtime = spec.runtime
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": _pod_security_context(),
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "containers": [_runtime_container(isvc)],
        "volumes": _rank_volumes(spec),
    }
    download = _download_container(spec)
    if download is not None:
        pod["initContainers"] = [download]
    if runtime.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in runtime.image_pull_secrets]
    _apply_scheduling(pod, spec)
    return pod


def _runtime_container(isvc: InferenceService) -> dict[str, Any]:
    spec = isvc.spec
    runtime = spec.runtime
    mounts = [
        {"name": "tmp", "mountPath": c.TMP_MOUNT},
        {"name": "cache", "mountPath": c.CACHE_MOUNT},
        {"name": "dshm", "mountPath": c.SHM_MOUNT},
    ]
    if spec.model.source in ("hf", "pvc"):
        mounts.append({"name": "model", "mountPath": c.MODELS_MOUNT, "readOnly": True})
    return {
        "name": "runtime",
        "image": runtime.image,
        "imagePullPolicy": runtime.image_pull_policy,
        "command": ["berth"],
        "args": ["serve", *runtime_args(spec)],
        "ports": [{"name": "http", "containerPort": c.HTTP_PORT, "protocol": "TCP"}],
        "env": _runtime_env(spec),
        "resources": _rank_resources(spec),
        "volumeMounts": mounts,
        "startupProbe": {
            "httpGet": {"path": c.HEALTH_PATH, "port": "http"},
            "periodSeconds": STARTUP_PROBE_PERIOD_SECONDS,
            "timeoutSeconds": 5,
            "failureThreshold": math.ceil(
                startup_budget_seconds(spec) / STARTUP_PROBE_PERIOD_SECONDS
            ),
        },
        # /health answers 503 while loading and while draining: a draining rank leaves its
        # Service (and the router) within two periods.
        "readinessProbe": {
            "httpGet": {"path": c.HEALTH_PATH, "port": "http"},
            "periodSeconds": 5,
            "timeoutSeconds": 5,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": c.HEALTH_PATH, "port": "http"},
            "periodSeconds": 15,
            "timeoutSeconds": 10,
            "failureThreshold": 4,
        },
        # Let the endpoints controller and the router drop this rank before SIGTERM starts
        # the runtime's drain of in-flight requests.
        "lifecycle": {
            "preStop": {"exec": {"command": ["sleep", str(runtime.pre_stop_sleep_seconds)]}}
        },
        "securityContext": _container_security_context(),
    }


def runtime_args(spec: InferenceServiceSpec) -> list[str]:
    """The `berth serve` flags for one rank (the rank itself comes from $(BERTH_DP_RANK))."""
    args = ["--host", "0.0.0.0", "--port", str(c.HTTP_PORT)]
    path = model_path(spec)
    if path is not None:
        args += ["--model", path]
    served_name = served_model_name(spec)
    if served_name is not None:
        args += ["--served-model-name", served_name]
    args += ["--dp-rank", f"$({c.ENV_DP_RANK})"]
    args += ["--graceful-shutdown-timeout", str(spec.runtime.graceful_shutdown_seconds)]
    args += ["--model-cache-dir", c.CACHE_MOUNT]
    a = spec.runtime.args
    for flag, value in (
        ("--dtype", a.dtype),
        ("--device", a.device),
        ("--context-length", a.context_length),
        ("--max-running-requests", a.max_running_requests),
        ("--max-total-tokens", a.max_total_tokens),
        ("--max-prefill-tokens", a.max_prefill_tokens),
        ("--chunked-prefill-size", a.chunked_prefill_size),
        ("--max-queued-requests", a.max_queued_requests),
        ("--schedule-policy", a.schedule_policy),
        ("--log-level", a.log_level),
    ):
        if value is not None:
            args += [flag, str(value)]
    if a.disable_radix_cache:
        args.append("--disable-radix-cache")
    return args + list(spec.runtime.extra_args)


def model_path(spec: InferenceServiceSpec) -> str | None:
    """What `--model` points at inside the rank container; None = the runtime's builtin model."""
    model = spec.model
    if model.source == "hf":
        return _join(hf_download_dir(spec), model.hf_file or "")
    if model.source == "pvc":
        return _join(c.MODELS_MOUNT, model.claim_path)
    if model.source == "file":
        return model.local_path
    return None


def served_model_name(spec: InferenceServiceSpec) -> str | None:
    """hf:// models are served under their repo id unless servedName says otherwise."""
    if spec.model.served_name:
        return spec.model.served_name
    if spec.model.source == "hf":
        return spec.model.hf_repo
    return None


def hf_download_dir(spec: InferenceServiceSpec) -> str:
    repo = spec.model.hf_repo or ""
    revision = spec.model.revision or "main"
    # One directory per repo and revision, so a shared cache claim can hold several models.
    return f"{c.MODELS_MOUNT}/hf/{repo.replace('/', '--')}@{revision.replace('/', '--')}"


def _join(base: str, tail: str) -> str:
    return base.rstrip("/") + "/" + tail.strip("/") if tail.strip("/") else base


def startup_budget_seconds(spec: InferenceServiceSpec) -> int:
    """How long a rank may take from container start to a ready /health."""
    if spec.runtime.startup_timeout_seconds is not None:
        return spec.runtime.startup_timeout_seconds
    model = spec.model
    if model.source == "builtin":
        return STARTUP_MIN_SECONDS
    size = model.size_gib if model.size_gib is not None else DEFAULT_MODEL_SIZE_GIB
    budget = STARTUP_BASE_SECONDS + size * LOAD_SECONDS_PER_GIB[model.source]
    budget = max(STARTUP_MIN_SECONDS, budget)
    return int(math.ceil(budget / STARTUP_PROBE_PERIOD_SECONDS) * STARTUP_PROBE_PERIOD_SECONDS)


def termination_grace_seconds(spec: InferenceServiceSpec) -> int:
    runtime = spec.runtime
    return (
        runtime.pre_stop_sleep_seconds
        + runtime.graceful_shutdown_seconds
        + TERMINATION_MARGIN_SECONDS
    )


def _runtime_env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {
            "name": c.ENV_DP_RANK,
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{c.POD_INDEX_LABEL}']"}},
        },
        # A read-only root filesystem: everything that caches goes to the writable volumes.
        {"name": "HOME", "value": c.TMP_MOUNT},
        {"name": "XDG_CACHE_HOME", "value": c.CACHE_MOUNT},
        {"name": "HF_HOME", "value": f"{c.CACHE_MOUNT}/huggingface"},
        # Ranks never fetch from the Hub: weights come from the image, a volume or the download.
        {"name": "HF_HUB_OFFLINE", "value": "1"},
    ]
    if spec.api_key is not None:
        env.append(
            {
                "name": c.ENV_API_KEY,
                "valueFrom": {"secretKeyRef": {"name": spec.api_key.name, "key": spec.api_key.key}},
            }
        )
    return env + [dict(e) for e in spec.runtime.env]


def _rank_resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    res = spec.resources
    requests: dict[str, Any] = {"cpu": res.cpu, "memory": res.memory}
    limits: dict[str, Any] = {"memory": res.memory_limit or res.memory}
    if res.cpu_limit is not None:
        limits["cpu"] = res.cpu_limit
    if res.gpus:
        requests[res.gpu_resource] = str(res.gpus)
        limits[res.gpu_resource] = str(res.gpus)
    return {"requests": requests, "limits": limits}


def _rank_volumes(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
        {
            "name": "dshm",
            "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shared_memory},
        },
    ]
    model = spec.model
    if model.source == "pvc":
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": model.claim_name, "readOnly": True},
            }
        )
    elif model.source == "hf":
        if model.cache_claim is not None:
            volumes.append(
                {"name": "model", "persistentVolumeClaim": {"claimName": model.cache_claim}}
            )
        else:
            empty_dir = {"sizeLimit": model.cache_size_limit} if model.cache_size_limit else {}
            volumes.append({"name": "model", "emptyDir": empty_dir})
    return volumes


def _download_container(spec: InferenceServiceSpec) -> dict[str, Any] | None:
    """hf:// weights: an init container fetches them before the runtime (and its probes) start."""
    model = spec.model
    if model.source != "hf":
        return None
    command = ["hf", "download", model.hf_repo or ""]
    if model.hf_file:
        command.append(model.hf_file)
    else:
        # The runtime reads safetensors; skip the other copies of the weights many repos carry.
        for pattern in HF_DOWNLOAD_EXCLUDES:
            command += ["--exclude", pattern]
    if model.revision:
        command += ["--revision", model.revision]
    command += ["--local-dir", hf_download_dir(spec)]
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": c.TMP_MOUNT},
        {"name": "HF_HOME", "value": f"{c.TMP_MOUNT}/huggingface"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    if model.hf_token is not None:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {
                    "secretKeyRef": {"name": model.hf_token.name, "key": model.hf_token.key}
                },
            }
        )
    res = spec.resources
    return {
        "name": "model-download",
        "image": spec.runtime.image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": command,
        "env": env,
        # No GPU while downloading; the same CPU and memory as the rank, so the pod's
        # effective request does not grow.
        "resources": {
            "requests": {"cpu": res.cpu, "memory": res.memory},
            "limits": {"memory": res.memory_limit or res.memory},
        },
        "volumeMounts": [
            {"name": "tmp", "mountPath": c.TMP_MOUNT},
            {"name": "model", "mountPath": c.MODELS_MOUNT},
        ],
        "securityContext": _container_security_context(),
    }


def _apply_scheduling(pod: dict[str, Any], spec: InferenceServiceSpec) -> None:
    scheduling = spec.scheduling
    if scheduling.node_selector:
        pod["nodeSelector"] = dict(scheduling.node_selector)
    if scheduling.tolerations:
        pod["tolerations"] = [dict(t) for t in scheduling.tolerations]
    if scheduling.affinity:
        pod["affinity"] = scheduling.affinity
    if scheduling.priority_class_name:
        pod["priorityClassName"] = scheduling.priority_class_name
    if scheduling.topology_spread_constraints:
        pod["topologySpreadConstraints"] = [dict(t) for t in scheduling.topology_spread_constraints]
    if scheduling.runtime_class_name:
        pod["runtimeClassName"] = scheduling.runtime_class_name


def _pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": c.RUN_AS_UID,
        "runAsGroup": c.RUN_AS_UID,
        "fsGroup": c.RUN_AS_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def build_headless_service(isvc: InferenceService) -> Manifest:
    """Stable DNS for every rank pod (<name>-<rank>.<name>-ranks), ready or not."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(isvc, headless_service_name(isvc.name), c.ROLE_RANK),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(isvc.name, c.ROLE_RANK),
            "ports": [_http_port(c.HTTP_PORT)],
        },
    }


def build_rank_services(isvc: InferenceService, plan: RankPlan | None = None) -> list[Manifest]:
    """One Service per routable rank: its endpoint exists only while that rank is ready."""
    plan = plan or RankPlan.of(isvc)
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": rank_service_name(isvc.name, rank),
                "namespace": isvc.namespace,
                "labels": {**labels(isvc.name, c.ROLE_RANK), c.LABEL_DP_RANK: str(rank)},
                "annotations": {c.LABEL_DP_RANK: str(rank)},
            },
            "spec": {
                "type": "ClusterIP",
                "selector": {
                    **selector_labels(isvc.name, c.ROLE_RANK),
                    c.POD_NAME_LABEL: rank_pod_name(isvc.name, rank),
                },
                "ports": [_http_port(c.HTTP_PORT)],
            },
        }
        for rank in plan.routable
    ]


def build_rank_pdb(isvc: InferenceService) -> Manifest:
    """Voluntary disruptions (node drains) take at most one rank at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(isvc, rank_statefulset_name(isvc.name), c.ROLE_RANK),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(isvc.name, c.ROLE_RANK)},
        },
    }


# --- router and entry point --------------------------------------------------------------------


def router_args(isvc: InferenceService) -> list[str]:
    """`berth router` flags: the policy, and where to discover the ranks.

    The router follows the per-rank Services' EndpointSlices itself, so the flags do not depend
    on the number of ranks: scaling never restarts the router (nor empties its prefix tree), and
    a rank that is not ready leaves the router as it leaves its Service.
    """
    spec = isvc.spec
    return [
        "--host",
        "0.0.0.0",
        "--port",
        str(c.HTTP_PORT),
        "--policy",
        ROUTER_POLICY_FLAGS[spec.routing.policy],
        "--discover-selector",
        rank_endpoints_selector(isvc.name),
        "--discover-namespace",
        isvc.namespace,
        "--discover-rank-label",
        c.LABEL_DP_RANK,
        "--discover-port-name",
        "http",
    ]


def build_router_service_account(isvc: InferenceService) -> Manifest:
    """The router's own identity: it may read EndpointSlices in this namespace, nothing else."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(isvc, router_name(isvc.name), c.ROLE_ROUTER),
        "automountServiceAccountToken": False,  # only the router pod mounts it, explicitly
    }


def build_router_role_binding(isvc: InferenceService) -> Manifest:
    """Grants the router's account the shipped `berth-router` ClusterRole (list and watch
    EndpointSlices) in this namespace only. The operator may bind that role and no other, so it
    needs no EndpointSlice access itself."""
    name = router_name(isvc.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(isvc, name, c.ROLE_ROUTER),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": c.ROUTER_CLUSTER_ROLE,
        },
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": isvc.namespace}],
    }


def build_router_deployment(isvc: InferenceService) -> Manifest:
    spec = isvc.spec
    runtime = spec.runtime
    env: list[dict[str, Any]] = [{"name": "HOME", "value": c.TMP_MOUNT}]
    if spec.api_key is not None:
        env.append(
            {
                "name": c.ENV_API_KEY,
                "valueFrom": {"secretKeyRef": {"name": spec.api_key.name, "key": spec.api_key.key}},
            }
        )
    pod: dict[str, Any] = {
        # The token lets the router list and watch the rank EndpointSlices (its RoleBinding).
        "serviceAccountName": router_name(isvc.name),
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        "securityContext": _pod_security_context(),
        # Streams pass through the router: give them as long as the ranks give them.
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "containers": [
            {
                "name": "router",
                "image": runtime.image,
                "imagePullPolicy": runtime.image_pull_policy,
                "command": ["berth"],
                "args": ["router", *router_args(isvc)],
                "ports": [{"name": "http", "containerPort": c.HTTP_PORT, "protocol": "TCP"}],
                "env": env,
                "resources": {
                    "requests": {"cpu": "250m", "memory": "256Mi"},
                    "limits": {"memory": "1Gi"},
                },
                "volumeMounts": [{"name": "tmp", "mountPath": c.TMP_MOUNT}],
                # Ready once it knows the ranks and has checked them; it does not turn unready
                # when every rank is down (it answers 503 itself, and the InferenceService's
                # status says RanksNotReady rather than RouterNotReady).
                "readinessProbe": {
                    "httpGet": {"path": c.ROUTER_READINESS_PATH, "port": "http"},
                    "periodSeconds": 5,
                    "timeoutSeconds": 5,
                    "failureThreshold": 2,
                },
                "livenessProbe": {
                    "httpGet": {"path": c.ROUTER_LIVENESS_PATH, "port": "http"},
                    "periodSeconds": 15,
                    "timeoutSeconds": 10,
                    "failureThreshold": 4,
                },
                "lifecycle": {
                    "preStop": {"exec": {"command": ["sleep", str(ROUTER_PRE_STOP_SECONDS)]}}
                },
                "securityContext": _container_security_context(),
            }
        ],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    if runtime.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in runtime.image_pull_secrets]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(isvc, router_name(isvc.name), c.ROLE_ROUTER),
        "spec": {
            "replicas": spec.routing.router_replicas,
            "selector": {"matchLabels": selector_labels(isvc.name, c.ROLE_ROUTER)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": {
                "metadata": {"labels": labels(isvc.name, c.ROLE_ROUTER)},
                "spec": pod,
            },
        },
    }


def build_router_pdb(isvc: InferenceService) -> Manifest:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(isvc, router_name(isvc.name), c.ROLE_ROUTER),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(isvc.name, c.ROLE_ROUTER)},
        },
    }


def build_entry_service(isvc: InferenceService) -> Manifest:
    """The single entry point: the router, or the ranks themselves when there is no router."""
    role = c.ROLE_ROUTER if isvc.spec.has_router else c.ROLE_RANK
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(isvc, entry_service_name(isvc.name), None),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(isvc.name, role),
            "ports": [_http_port(c.SERVICE_PORT)],
        },
    }


def build_ingress(isvc: InferenceService) -> Manifest:
    ingress = isvc.spec.ingress
    assert ingress is not None  # callers check spec.ingress
    rule: dict[str, Any] = {
        "http": {
            "paths": [
                {
                    "path": ingress.path,
                    "pathType": ingress.path_type,
                    "backend": {
                        "service": {
                            "name": entry_service_name(isvc.name),
                            "port": {"name": "http"},
                        }
                    },
                }
            ]
        }
    }
    if ingress.host:
        rule = {"host": ingress.host, **rule}
    metadata = _metadata(isvc, isvc.name, None)
    if ingress.annotations:
        metadata["annotations"] = dict(ingress.annotations)
    spec: dict[str, Any] = {"rules": [rule]}
    if ingress.class_name:
        spec["ingressClassName"] = ingress.class_name
    if ingress.tls_secret:
        spec["tls"] = [{"hosts": [ingress.host], "secretName": ingress.tls_secret}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": metadata,
        "spec": spec,
    }


def ingress_url(isvc: InferenceService, load_balancer_address: str | None = None) -> str | None:
    """The public OpenAI base URL, when the Ingress has a host or has been given an address."""
    ingress = isvc.spec.ingress
    if ingress is None:
        return None
    host = ingress.host or load_balancer_address
    if not host or host.startswith("*"):
        return None
    scheme = "https" if ingress.tls_secret else "http"
    return f"{scheme}://{host}{ingress.path.rstrip('/')}/v1"


def _http_port(port: int) -> dict[str, Any]:
    return {"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}
