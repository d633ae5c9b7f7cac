"""The rank StatefulSet: one pod per DP rank running `berth serve`, and its PodDisruptionBudget.

The pod template carries everything a rank needs: the `berth serve` flags, the model volume (and
the init container that downloads hf:// weights), probes sized to the model, the drain on stop,
placement, and a locked-down security context.
"""

from __future__ import annotations

import math
from typing import Any

from berth_operator import constants as c
from berth_operator.builders.keys import key_args, key_mounts, key_volumes
from berth_operator.builders.parts import (
    Manifest,
    container_security_context,
    metadata,
    one_at_a_time_pdb,
    pod_security_context,
)
from berth_operator.naming import (
    headless_service_name,
    labels,
    rank_statefulset_name,
    selector_labels,
)
from berth_operator.nodes import quantity_units
from berth_operator.plan import RankPlan, RankSet
from berth_operator.spec import InferenceService, InferenceServiceSpec

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
HF_DOWNLOAD_EXCLUDES = ("original/*", "*.pth", "*.pt", "*.bin", "*.msgpack", "*.h5", "*.onnx")


def build_rank_statefulset(
    isvc: InferenceService, plan: RankPlan | None = None, rank_set: RankSet | None = None
) -> Manifest:
    """One pod per DP rank; the ordinal is the rank, and a rank never surges onto a second GPU.

    With `rank_set` (a service placed by AcceleratorPools), the StatefulSet holds that rank set's
    ranks in its pool: its ordinals start at the set's first rank, so that every pod's ordinal is
    still its rank, and its selector names the set (the first set keeps the plain name and
    selector, which select no pod of another set: a StatefulSet only manages pods it owns)."""
    plan = plan or RankPlan.of(isvc)
    index = rank_set.index if rank_set is not None else 0
    meta = metadata(isvc, rank_statefulset_name(isvc.name, index), c.ROLE_RANK)
    selector = selector_labels(isvc.name, c.ROLE_RANK)
    pod_labels = {**labels(isvc.name, c.ROLE_RANK), c.LABEL_ENGINE_TYPE: c.ENGINE_TYPE}
    spec: dict[str, Any] = {"serviceName": headless_service_name(isvc.name), "replicas": plan.pods}
    if rank_set is not None:
        # The quota ledger reads the claim back from these (quota.py), after a restart too.
        meta["labels"][c.LABEL_POOL] = rank_set.pool
        meta["annotations"] = {c.ANNOTATION_PER_RANK: str(rank_set.per_rank)}
        pod_labels[c.LABEL_POOL] = rank_set.pool
        spec["replicas"] = rank_set.count
        if index:
            selector = {**selector, c.LABEL_RANK_SET: str(index)}
            pod_labels[c.LABEL_RANK_SET] = str(index)
            spec["ordinals"] = {"start": rank_set.start}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta,
        "spec": {
            **spec,
            # Ranks load in parallel; rolling updates still replace one rank at a time.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {
                    "labels": pod_labels,
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
        "securityContext": pod_security_context(),
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "containers": [_runtime_container(isvc)],
        "volumes": _rank_volumes(spec),
    }
    download = _download_container(spec)
    if download is not None:
        pod["initContainers"] = [download]
    if runtime.image_pull_secrets:
        pod["imagePullSecrets"] = [dict(ref) for ref in runtime.image_pull_secrets]
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
    mounts += key_mounts(spec)
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
        "securityContext": container_security_context(),
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
    if spec.parallelism.tensor > 1:
        args += ["--tp-size", str(spec.parallelism.tensor)]
    args += ["--graceful-shutdown-timeout", str(spec.runtime.graceful_shutdown_seconds)]
    args += ["--model-cache-dir", c.CACHE_MOUNT]
    args += key_args(spec)
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
        ("--grammar-backend", a.grammar_backend),
        ("--tool-call-parser", a.tool_call_parser),
        ("--reasoning-parser", a.reasoning_parser),
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
    return env + [dict(e) for e in spec.runtime.env]


def _rank_resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    res = spec.resources
    requests: dict[str, Any] = {"cpu": res.cpu, "memory": res.memory}
    limits: dict[str, Any] = {"memory": res.memory_limit or res.memory}
    if res.cpu_limit is not None:
        limits["cpu"] = res.cpu_limit
    if spec.rank_gpus:
        requests[res.gpu_resource] = str(spec.rank_gpus)
        limits[res.gpu_resource] = str(spec.rank_gpus)
    return {"requests": requests, "limits": limits}


def shared_memory_size(spec: InferenceServiceSpec) -> str:
    """/dev/shm's size: resources.sharedMemory for each tensor-parallel process (NCCL keeps its
    buffers between the GPUs of a pod there)."""
    size, tensor = spec.resources.shared_memory, spec.parallelism.tensor
    if tensor == 1:
        return size
    total = quantity_units(size) * tensor
    for suffix, unit in (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if total % unit == 0:
            return f"{total // unit}{suffix}"
    return str(total)


def _rank_volumes(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
        {
            "name": "dshm",
            "emptyDir": {"medium": "Memory", "sizeLimit": shared_memory_size(spec)},
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
        if model.cache.claim_name is not None:
            volumes.append(
                {"name": "model", "persistentVolumeClaim": {"claimName": model.cache.claim_name}}
            )
        else:
            size_limit = model.cache.size_limit
            empty_dir = {"sizeLimit": size_limit} if size_limit else {}
            volumes.append({"name": "model", "emptyDir": empty_dir})
    return volumes + key_volumes(spec)


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
        "securityContext": container_security_context(),
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


def build_rank_pdb(isvc: InferenceService) -> Manifest:
    """Voluntary disruptions (node drains) take at most one rank at a time."""
    return one_at_a_time_pdb(isvc, rank_statefulset_name(isvc.name), c.ROLE_RANK)
