"""InferenceService: the typed, defaulted, validated view of a resource; SpecError says what to fix.

The CRD's schema, keyed lists and CEL rules reject most bad input at the API server. This module
checks the same rules again (`berth operator render` reads files no API server has seen, and an
object stored under an older CRD may break a newer rule) plus the rules only the operator knows
(what the runtime supports, which flags the operator owns), and applies the same defaults as the
CRD, so that a spec read straight from a file renders exactly like the stored one. What neither
can see (a misspelt key inside a pass-through field such as `affinity`) the API server finds when
the children are applied strictly.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from berth_operator import constants

T = TypeVar("T")


class SpecError(ValueError):
    """The spec cannot be turned into workloads; the message names each field and what to fix."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


# Kubernetes' own formats (apimachinery validation), used by both the CRD and this module.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
    r"|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
DNS1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
EXTENDED_RESOURCE = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[-a-zA-Z0-9_.]+$"
# A C identifier-ish env var name, as `kubectl` accepts them.
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
HF_REPO = r"[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*"
MODEL_URI_PATTERN = (
    r"^(builtin://[a-z0-9][-a-z0-9.]*"
    rf"|hf://{HF_REPO}(/[^\s]+\.gguf)?"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?"
    r"|file:///[^\s]*)$"
)

# The longest child name is "<name>-rank-<63>"; the StatefulSet's controller-revision-hash label
# ("<name>-<10 chars>") must fit in 63 characters too.
MAX_NAME_LENGTH = 45
MAX_REPLICAS = 64
MAX_ROUTER_REPLICAS = 16
BUILTIN_MODELS = ("smollm2-135m-instruct",)
DEFAULT_BUILTIN_URI = "builtin://smollm2-135m-instruct"

# Flags the operator renders itself; `runtime.extraArgs` may not repeat or override them.
MANAGED_FLAGS = (
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--api-key",
    "--dp-rank",
    "--tp-size",
    "--model-cache-dir",
    "--graceful-shutdown-timeout",
)
# Environment variables the operator sets on the runtime container; `runtime.env` may not repeat
# them (a container's env is a list keyed by name: a repeat is a duplicate key, not an override).
MANAGED_ENV = (
    constants.ENV_API_KEY,
    constants.ENV_DP_RANK,
    "HOME",
    "XDG_CACHE_HOME",
    "HF_HOME",
    "HF_HUB_OFFLINE",
)

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULE_POLICIES = ("fcfs", "lpm", "priority")
LOG_LEVELS = ("debug", "info", "warning", "error")
ROUTING_POLICIES = ("cacheAware", "leastLoad", "roundRobin")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
PATH_TYPES = ("Prefix", "Exact", "ImplementationSpecific")
TOLERATION_OPERATORS = ("Exists", "Equal")
TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
WHEN_UNSATISFIABLE = ("DoNotSchedule", "ScheduleAnyway")

ModelSource = Literal["builtin", "hf", "pvc", "file"]


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class ModelSpec:
    uri: str
    source: ModelSource
    served_name: str | None = None
    size_gib: float | None = None
    # hf://org/repo[/file.gguf]
    hf_repo: str | None = None
    hf_file: str | None = None
    revision: str | None = None
    hf_token: SecretKeyRef | None = None
    cache_claim: str | None = None
    cache_size_limit: str | None = None
    # pvc://claim/path
    claim_name: str | None = None
    claim_path: str = ""
    # file:///path
    local_path: str | None = None


@dataclass(frozen=True)
class RuntimeArgs:
    """The `berth serve` knobs a user may set; None = the runtime's own default."""

    dtype: str | None = None
    device: str | None = None
    context_length: int | None = None
    max_running_requests: int | None = None
    max_total_tokens: int | None = None
    max_prefill_tokens: int | None = None
    chunked_prefill_size: int | None = None
    max_queued_requests: int | None = None
    schedule_policy: str | None = None
    disable_radix_cache: bool = False
    log_level: str | None = None


@dataclass(frozen=True)
class RuntimeSpec:
    image: str = constants.DEFAULT_RUNTIME_IMAGE
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    args: RuntimeArgs = field(default_factory=RuntimeArgs)
    graceful_shutdown_seconds: int = 60
    pre_stop_sleep_seconds: int = 10
    startup_timeout_seconds: int | None = None
    extra_args: tuple[str, ...] = ()
    env: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class ResourcesSpec:
    gpus: int = 0
    gpu_resource: str = "nvidia.com/gpu"
    cpu: str = "1"
    memory: str = "4Gi"
    cpu_limit: str | None = None
    memory_limit: str | None = None
    shared_memory: str = "1Gi"


@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    target_queue_per_rank: float = 4.0
    token_usage_ceiling: float = 0.85
    scale_up_stabilization_seconds: int = 30
    scale_down_delay_seconds: int = 300


@dataclass(frozen=True)
class HealthSpec:
    """When a rank counts as stalled, and what the operator does about it."""

    stall_timeout_seconds: int = 30
    restart_after_seconds: int = 120  # 0: withdraw a stalled rank, never restart it
    imbalance_window_seconds: int = 60


@dataclass(frozen=True)
class RoutingSpec:
    policy: str = "cacheAware"
    router_replicas: int = 1


@dataclass(frozen=True)
class IngressSpec:
    host: str | None = None
    path: str = "/"
    path_type: str = "Prefix"
    class_name: str | None = None
    annotations: tuple[tuple[str, str], ...] = ()
    tls_secret: str | None = None


@dataclass(frozen=True)
class SchedulingSpec:
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[dict[str, Any], ...] = ()
    affinity: dict[str, Any] | None = None
    priority_class_name: str | None = None
    topology_spread_constraints: tuple[dict[str, Any], ...] = ()
    runtime_class_name: str | None = None


@dataclass(frozen=True)
class InferenceServiceSpec:
    model: ModelSpec
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    tensor_parallel: int = 1
    replicas: int = 1
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    health: HealthSpec = field(default_factory=HealthSpec)
    routing: RoutingSpec = field(default_factory=RoutingSpec)
    ingress: IngressSpec | None = None
    api_key: SecretKeyRef | None = None
    scheduling: SchedulingSpec = field(default_factory=SchedulingSpec)

    @property
    def ranks(self) -> int:
        """How many DP ranks to run: `replicas`, kept within the autoscaling bounds when enabled."""
        if not self.autoscaling.enabled:
            return self.replicas
        return min(max(self.replicas, self.autoscaling.min_replicas), self.autoscaling.max_replicas)

    @property
    def has_router(self) -> bool:
        return self.routing.router_replicas > 0

    @classmethod
    def from_spec(
        cls, spec: Mapping[str, Any] | None, *, default_image: str | None = None
    ) -> InferenceServiceSpec:
        """Parse `.spec`; raise SpecError listing every problem found."""
        problems: list[str] = []
        root = _Fields(spec if spec is not None else {}, "spec", problems)
        parsed = _parse_spec(root, default_image or constants.DEFAULT_RUNTIME_IMAGE)
        root.reject_unknown()
        if problems:
            raise SpecError(problems)
        return parsed


@dataclass(frozen=True)
class InferenceService:
    """One InferenceService resource: its identity plus the parsed spec."""

    name: str
    namespace: str
    spec: InferenceServiceSpec
    uid: str | None = None
    generation: int | None = None

    @classmethod
    def from_body(
        cls, body: Mapping[str, Any], *, default_image: str | None = None
    ) -> InferenceService:
        """Parse a whole resource (as stored, or as written in a file)."""
        problems: list[str] = []
        if body.get("apiVersion") not in (None, constants.API_VERSION):
            problems.append(
                f"apiVersion: expected {constants.API_VERSION}, got {body.get('apiVersion')!r}"
            )
        if body.get("kind") not in (None, constants.KIND):
            problems.append(f"kind: expected {constants.KIND}, got {body.get('kind')!r}")
        meta = body.get("metadata") or {}
        name = meta.get("name") if isinstance(meta, Mapping) else None
        namespace = (meta.get("namespace") if isinstance(meta, Mapping) else None) or "default"
        problems.extend(name_problems(name))
        try:
            spec = InferenceServiceSpec.from_spec(body.get("spec"), default_image=default_image)
        except SpecError as e:
            problems.extend(e.problems)
        if problems:
            raise SpecError(problems)
        return cls(
            name=name,
            namespace=namespace,
            spec=spec,
            uid=meta.get("uid"),
            generation=meta.get("generation"),
        )


def name_problems(name: object) -> list[str]:
    """Child names are built from the resource's name, so it must be a short DNS-1035 label."""
    if not isinstance(name, str) or not name:
        return ["metadata.name: required"]
    problems = []
    if len(name) > MAX_NAME_LENGTH:
        problems.append(
            f"metadata.name: {name!r} is {len(name)} characters; at most {MAX_NAME_LENGTH} "
            "(child names such as <name>-rank-<N> must stay within 63)"
        )
    if not re.match(DNS1035_LABEL, name):
        problems.append(
            f"metadata.name: {name!r} must be lowercase letters, digits and '-', start with a "
            "letter and end with a letter or digit (it names Services)"
        )
    return problems


def _parse_spec(root: _Fields, default_image: str) -> InferenceServiceSpec:
    model = _parse_model(root.obj("model"))
    runtime = _parse_runtime(root.obj("runtime"), default_image)
    resources = _parse_resources(root.obj("resources"))
    parallelism = root.obj("parallelism")
    tensor = parallelism.integer("tensor", 1, minimum=1, maximum=8)
    parallelism.reject_unknown()
    replicas = root.integer("replicas", 1, minimum=0, maximum=MAX_REPLICAS)
    autoscaling = _parse_autoscaling(root.obj("autoscaling"))
    health = _parse_health(root.obj("health"))
    routing = _parse_routing(root.obj("routing"))
    ingress = _parse_ingress(root.obj("ingress")) if root.has("ingress") else None
    api_key = _parse_secret_ref(root, "apiKeySecretRef", default_key="api-key")
    scheduling = _parse_scheduling(root.obj("scheduling"))

    if tensor != 1:
        root.problem(
            "parallelism.tensor",
            f"{tensor} is not supported by the runtime yet (only 1); "
            "scale out with spec.replicas (data-parallel ranks) instead",
        )
    if resources.gpus and resources.gpus < tensor:
        root.problem(
            "resources.gpus",
            f"{resources.gpus} GPUs cannot hold parallelism.tensor={tensor}; "
            "request at least as many GPUs as tensor-parallel ranks",
        )
    if autoscaling.min_replicas > autoscaling.max_replicas:
        root.problem(
            "autoscaling",
            f"minReplicas ({autoscaling.min_replicas}) must not exceed maxReplicas "
            f"({autoscaling.max_replicas})",
        )
    if runtime.args.device == "cuda" and resources.gpus == 0:
        root.problem(
            "runtime.args.device",
            "cuda needs GPUs: set resources.gpus to at least 1, or use device auto or cpu",
        )
    return InferenceServiceSpec(
        model=model,
        runtime=runtime,
        resources=resources,
        tensor_parallel=tensor,
        replicas=replicas,
        autoscaling=autoscaling,
        health=health,
        routing=routing,
        ingress=ingress,
        api_key=api_key,
        scheduling=scheduling,
    )


def _parse_model(f: _Fields) -> ModelSpec:
    uri = f.text("uri", DEFAULT_BUILTIN_URI, pattern=MODEL_URI_PATTERN, what="a model URI")
    served_name = f.text("servedName", None, max_length=256)
    size_gib = f.number("sizeGiB", None, exclusive_minimum=0, maximum=4096)
    revision = f.text("revision", None, max_length=256)
    hf_token = _parse_secret_ref(f, "hfTokenSecretRef", default_key="token")
    cache = f.obj("cache")
    cache_claim = cache.text("claimName", None, pattern=DNS1123_SUBDOMAIN, what="a PVC name")
    cache_size = cache.quantity("sizeLimit", None)
    cache.reject_unknown()
    f.reject_unknown()

    scheme, _, rest = uri.partition("://")
    source: ModelSource = scheme if scheme in ("builtin", "hf", "pvc", "file") else "builtin"  # type: ignore[assignment]
    kwargs: dict[str, Any] = {}
    if source == "builtin":
        if rest not in BUILTIN_MODELS:
            f.problem(
                "uri",
                f"unknown builtin model {rest!r}; the runtime embeds "
                + ", ".join(f"builtin://{m}" for m in BUILTIN_MODELS),
            )
    elif source == "hf":
        parts = rest.split("/", 2)
        kwargs["hf_repo"] = "/".join(parts[:2])
        kwargs["hf_file"] = parts[2] if len(parts) > 2 else None
    elif source == "pvc":
        claim, _, path = rest.partition("/")
        kwargs["claim_name"] = claim
        kwargs["claim_path"] = path.strip("/")
        if ".." in path.split("/"):
            f.problem("uri", "a pvc:// path may not contain '..'")
    elif source == "file":
        kwargs["local_path"] = "/" + rest.lstrip("/")
    if source != "hf":
        for key, value in (
            ("revision", revision),
            ("hfTokenSecretRef", hf_token),
            ("cache", cache_claim or cache_size),
        ):
            if value:
                f.problem(key, "applies to hf:// models only")
    if cache_claim and cache_size:
        f.problem("cache", "set either claimName (a PVC) or sizeLimit (an emptyDir), not both")
    return ModelSpec(
        uri=uri,
        source=source,
        served_name=served_name,
        size_gib=size_gib,
        revision=revision,
        hf_token=hf_token,
        cache_claim=cache_claim,
        cache_size_limit=cache_size,
        **kwargs,
    )


def _parse_runtime(f: _Fields, default_image: str) -> RuntimeSpec:
    image = f.text("image", default_image, max_length=512, min_length=1) or default_image
    pull_policy = f.enum("imagePullPolicy", "IfNotPresent", PULL_POLICIES)
    pull_secrets: list[str] = []
    for i, item in enumerate(f.items("imagePullSecrets")):
        ref = f.nested(item, f"imagePullSecrets[{i}]")
        secret = ref.text("name", None, pattern=DNS1123_SUBDOMAIN, what="a Secret name")
        ref.reject_unknown()
        if secret is None:
            ref.problem("name", "required")
        elif secret in pull_secrets:
            ref.problem("name", f"duplicate entry {secret!r}: each Secret once")
        else:
            pull_secrets.append(secret)
    a = f.obj("args")
    args = RuntimeArgs(
        dtype=a.enum("dtype", None, DTYPES),
        device=a.enum("device", None, DEVICES),
        context_length=a.integer("contextLength", None, minimum=1),
        max_running_requests=a.integer("maxRunningRequests", None, minimum=1),
        max_total_tokens=a.integer("maxTotalTokens", None, minimum=1),
        max_prefill_tokens=a.integer("maxPrefillTokens", None, minimum=1),
        chunked_prefill_size=a.integer("chunkedPrefillSize", None),
        max_queued_requests=a.integer("maxQueuedRequests", None, minimum=1),
        schedule_policy=a.enum("schedulePolicy", None, SCHEDULE_POLICIES),
        disable_radix_cache=a.flag("disableRadixCache", False),
        log_level=a.enum("logLevel", None, LOG_LEVELS),
    )
    a.reject_unknown()
    grace = f.integer("gracefulShutdownSeconds", 60, minimum=0, maximum=3600)
    pre_stop = f.integer("preStopSleepSeconds", 10, minimum=0, maximum=300)
    startup = f.integer("startupTimeoutSeconds", None, minimum=30, maximum=86400)
    extra_args: list[str] = []
    for i, arg in enumerate(f.items("extraArgs")):
        if not isinstance(arg, str):
            f.problem(f"extraArgs[{i}]", f"must be a string, got {arg!r}")
            continue
        managed = _managed_flag(arg)
        if managed:
            flag = arg.split("=", 1)[0]
            named = managed if flag == managed else f"{flag} (read as {managed})"
            f.problem(
                f"extraArgs[{i}]",
                f"{named} is set by the operator; use the matching spec field instead "
                "(model.uri, model.servedName, apiKeySecretRef, runtime.gracefulShutdownSeconds, "
                "parallelism.tensor)",
            )
        extra_args.append(arg)
    env: list[dict[str, Any]] = []
    for i, item in enumerate(f.items("env")):
        var = f.nested(item, f"env[{i}]")
        var_name = var.text("name", None, pattern=ENV_NAME, what="an environment variable name")
        value = var.text("value", None)
        value_from = var.raw_obj("valueFrom")
        var.reject_unknown()
        if var_name is None:
            var.problem("name", "required")
            continue
        if var_name in MANAGED_ENV:
            var.problem("name", f"{var_name} is set by the operator")
        if any(e["name"] == var_name for e in env):
            var.problem("name", f"duplicate entry {var_name!r}: each variable once")
        if value is not None and value_from is not None:
            var.problem("value", "set either value or valueFrom, not both")
        entry: dict[str, Any] = {"name": var_name}
        if value is not None:
            entry["value"] = value
        if value_from is not None:
            entry["valueFrom"] = value_from
        env.append(entry)
    f.reject_unknown()
    return RuntimeSpec(
        image=image,
        image_pull_policy=pull_policy,
        image_pull_secrets=tuple(pull_secrets),
        args=args,
        graceful_shutdown_seconds=grace,
        pre_stop_sleep_seconds=pre_stop,
        startup_timeout_seconds=startup,
        extra_args=tuple(extra_args),
        env=tuple(env),
    )


def _managed_flag(arg: str) -> str | None:
    """The operator-owned flag `arg` names, if any (argparse also accepts unique prefixes)."""
    flag = arg.split("=", 1)[0]
    if not flag.startswith("--") or len(flag) < 4:
        return None
    return next((m for m in MANAGED_FLAGS if m.startswith(flag)), None)


def _parse_resources(f: _Fields) -> ResourcesSpec:
    parsed = ResourcesSpec(
        gpus=f.integer("gpus", 0, minimum=0, maximum=16),
        gpu_resource=f.text(
            "gpuResource", "nvidia.com/gpu", pattern=EXTENDED_RESOURCE, what="a resource name"
        ),
        cpu=f.quantity("cpu", "1"),
        memory=f.quantity("memory", "4Gi"),
        cpu_limit=f.quantity("cpuLimit", None),
        memory_limit=f.quantity("memoryLimit", None),
        shared_memory=f.quantity("sharedMemory", "1Gi"),
    )
    f.reject_unknown()
    return parsed


def _parse_autoscaling(f: _Fields) -> AutoscalingSpec:
    parsed = AutoscalingSpec(
        enabled=f.flag("enabled", False),
        min_replicas=f.integer("minReplicas", 1, minimum=1, maximum=MAX_REPLICAS),
        max_replicas=f.integer("maxReplicas", 4, minimum=1, maximum=MAX_REPLICAS),
        target_queue_per_rank=f.number("targetQueuePerRank", 4.0, exclusive_minimum=0),
        token_usage_ceiling=f.number("tokenUsageCeiling", 0.85, exclusive_minimum=0, maximum=1),
        scale_up_stabilization_seconds=f.integer(
            "scaleUpStabilizationSeconds", 30, minimum=0, maximum=3600
        ),
        scale_down_delay_seconds=f.integer("scaleDownDelaySeconds", 300, minimum=0, maximum=86400),
    )
    f.reject_unknown()
    return parsed


def _parse_health(f: _Fields) -> HealthSpec:
    parsed = HealthSpec(
        stall_timeout_seconds=f.integer("stallTimeoutSeconds", 30, minimum=1, maximum=3600),
        restart_after_seconds=f.integer("restartAfterSeconds", 120, minimum=0, maximum=86400),
        imbalance_window_seconds=f.integer("imbalanceWindowSeconds", 60, minimum=1, maximum=3600),
    )
    f.reject_unknown()
    return parsed


def _parse_routing(f: _Fields) -> RoutingSpec:
    parsed = RoutingSpec(
        policy=f.enum("policy", "cacheAware", ROUTING_POLICIES),
        router_replicas=f.integer("routerReplicas", 1, minimum=0, maximum=MAX_ROUTER_REPLICAS),
    )
    f.reject_unknown()
    return parsed


def _parse_ingress(f: _Fields) -> IngressSpec:
    host = f.text("host", None, pattern=r"^(\*\.)?" + DNS1123_SUBDOMAIN[1:], what="a DNS name")
    path = f.text("path", "/", pattern=r"^/[^\s]*$", what="an absolute URL path")
    path_type = f.enum("pathType", "Prefix", PATH_TYPES)
    class_name = f.text("className", None, pattern=DNS1123_SUBDOMAIN, what="an IngressClass name")
    annotations = f.string_map("annotations")
    tls = f.obj("tls")
    tls_secret = tls.text("secretName", None, pattern=DNS1123_SUBDOMAIN, what="a Secret name")
    if f.has("tls") and tls_secret is None:
        tls.problem("secretName", "required when tls is set")
    tls.reject_unknown()
    if tls_secret and not host:
        f.problem("tls", "needs ingress.host: a certificate is issued for a host name")
    f.reject_unknown()
    return IngressSpec(
        host=host,
        path=path,
        path_type=path_type,
        class_name=class_name,
        annotations=annotations,
        tls_secret=tls_secret,
    )


def _parse_secret_ref(f: _Fields, key: str, *, default_key: str) -> SecretKeyRef | None:
    if not f.has(key):
        return None
    ref = f.obj(key)
    name = ref.text("name", None, pattern=DNS1123_SUBDOMAIN, what="a Secret name")
    secret_key = ref.text("key", default_key, pattern=r"^[-._a-zA-Z0-9]+$", what="a Secret key")
    ref.reject_unknown()
    if name is None:
        ref.problem("name", "required")
        return None
    return SecretKeyRef(name=name, key=secret_key)


def _parse_scheduling(f: _Fields) -> SchedulingSpec:
    tolerations = []
    for i, item in enumerate(f.items("tolerations")):
        t = f.nested(item, f"tolerations[{i}]")
        toleration = {
            "key": t.text("key", None),
            "operator": t.enum("operator", None, TOLERATION_OPERATORS),
            "value": t.text("value", None),
            "effect": t.enum("effect", None, TOLERATION_EFFECTS),
            "tolerationSeconds": t.integer("tolerationSeconds", None),
        }
        t.reject_unknown()
        tolerations.append({k: v for k, v in toleration.items() if v is not None})
    spread: list[dict[str, Any]] = []
    for i, item in enumerate(f.items("topologySpreadConstraints")):
        if not isinstance(item, Mapping):
            f.problem(f"topologySpreadConstraints[{i}]", "must be an object")
            continue
        # The rest passes through as written; the API server checks it (strictly) on apply.
        t = f.nested(item, f"topologySpreadConstraints[{i}]")
        keys = (
            t.text("topologyKey", None, min_length=1, max_length=316),
            t.enum("whenUnsatisfiable", None, WHEN_UNSATISFIABLE),
        )
        max_skew = t.integer("maxSkew", None, minimum=1)
        for key, value in (("topologyKey", keys[0]), ("whenUnsatisfiable", keys[1])):
            if value is None and key not in item:
                t.problem(key, "required")
        if max_skew is None and "maxSkew" not in item:
            t.problem("maxSkew", "required")
        if None not in keys and any(
            (s.get("topologyKey"), s.get("whenUnsatisfiable")) == keys for s in spread
        ):
            t.problem(
                "topologyKey",
                f"duplicate entry for {keys[0]!r} and {keys[1]}: each pair once",
            )
        spread.append(dict(item))
    parsed = SchedulingSpec(
        node_selector=f.string_map("nodeSelector"),
        tolerations=tuple(tolerations),
        affinity=f.raw_obj("affinity"),
        priority_class_name=f.text(
            "priorityClassName", None, pattern=DNS1123_SUBDOMAIN, what="a PriorityClass name"
        ),
        topology_spread_constraints=tuple(spread),
        runtime_class_name=f.text(
            "runtimeClassName", None, pattern=DNS1123_SUBDOMAIN, what="a RuntimeClass name"
        ),
    )
    f.reject_unknown()
    return parsed


class _Fields:
    """Reads one object of the spec: typed getters that record problems and return defaults."""

    def __init__(self, raw: object, path: str, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        self.seen: set[str] = set()
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            problems.append(f"{path}: must be an object, got {_show(raw)}")
            raw = {}
        self.raw: Mapping[str, Any] = raw

    def problem(self, key: str, message: str) -> None:
        self.problems.append(f"{self.path}.{key}: {message}")

    def has(self, key: str) -> bool:
        self.seen.add(key)
        return self.raw.get(key) is not None

    def nested(self, raw: object, key: str) -> _Fields:
        return _Fields(raw, f"{self.path}.{key}", self.problems)

    def obj(self, key: str) -> _Fields:
        self.seen.add(key)
        return self.nested(self.raw.get(key), key)

    def _get(self, key: str, default: T, check: Callable[[Any], bool], expected: str) -> Any:
        self.seen.add(key)
        value = self.raw.get(key)
        if value is None:
            return default
        if not check(value):
            self.problem(key, f"must be {expected}, got {_show(value)}")
            return default
        return value

    def text(
        self,
        key: str,
        default: T,
        *,
        pattern: str | None = None,
        what: str | None = None,
        max_length: int = 253,
        min_length: int = 0,
    ) -> str | T:
        value = self._get(key, default, lambda v: isinstance(v, str), "a string")
        if value is default or value is None:
            return value
        if not min_length <= len(value) <= max_length:
            self.problem(key, f"must be {min_length} to {max_length} characters long")
            return default
        if pattern is not None and not re.match(pattern, value):
            self.problem(key, f"{value!r} is not {what or 'valid'}")
            return default
        return value

    def integer(
        self, key: str, default: T, *, minimum: int | None = None, maximum: int | None = None
    ) -> int | T:
        value = self._get(
            key, default, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"
        )
        if value is default or value is None:
            return value
        return self._bounded(key, value, default, minimum, maximum)

    def number(
        self,
        key: str,
        default: T,
        *,
        exclusive_minimum: float | None = None,
        maximum: float | None = None,
    ) -> float | T:
        value = self._get(
            key,
            default,
            lambda v: isinstance(v, int | float) and not isinstance(v, bool),
            "a number",
        )
        if value is default or value is None:
            return value
        if exclusive_minimum is not None and value <= exclusive_minimum:
            self.problem(key, f"must be greater than {exclusive_minimum}, got {value}")
            return default
        return float(self._bounded(key, value, default, None, maximum))

    def _bounded(
        self, key: str, value: Any, default: Any, minimum: float | None, maximum: float | None
    ) -> Any:
        if minimum is not None and value < minimum:
            self.problem(key, f"must be at least {minimum}, got {value}")
            return default
        if maximum is not None and value > maximum:
            self.problem(key, f"must be at most {maximum}, got {value}")
            return default
        return value

    def flag(self, key: str, default: bool) -> bool:
        return self._get(key, default, lambda v: isinstance(v, bool), "true or false")

    def enum(self, key: str, default: T, choices: tuple[str, ...]) -> str | T:
        value = self._get(key, default, lambda v: isinstance(v, str), "a string")
        if value is default or value is None:
            return value
        if value not in choices:
            self.problem(key, f"{value!r} is not one of {', '.join(choices)}")
            return default
        return value

    def quantity(self, key: str, default: T) -> str | T:
        value = self._get(
            key,
            default,
            lambda v: isinstance(v, str | int) and not isinstance(v, bool),
            "a quantity such as 500m, 2 or 16Gi",
        )
        if value is default or value is None:
            return value
        if not re.match(QUANTITY_PATTERN, str(value)):
            self.problem(key, f"{value!r} is not a quantity such as 500m, 2 or 16Gi")
            return default
        return str(value)

    def items(self, key: str) -> list[Any]:
        return list(self._get(key, [], lambda v: isinstance(v, list), "a list"))

    def string_map(self, key: str) -> tuple[tuple[str, str], ...]:
        value = self._get(key, {}, lambda v: isinstance(v, Mapping), "an object")
        bad = [k for k, v in value.items() if not isinstance(v, str)]
        if bad:
            self.problem(key, f"values must be strings (quote them in YAML): {', '.join(bad)}")
            return ()
        return tuple(sorted(value.items()))

    def raw_obj(self, key: str) -> dict[str, Any] | None:
        value = self._get(key, None, lambda v: isinstance(v, Mapping), "an object")
        return dict(value) if value is not None else None

    def reject_unknown(self) -> None:
        unknown = sorted(set(self.raw) - self.seen)
        for key in unknown:
            known = ", ".join(sorted(self.seen)) or "none"
            self.problem(key, f"unknown field (known here: {known})")


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
