"""AcceleratorPool: the admin's cluster-scoped description of one kind of accelerator, where it
runs, what ranks on it default to, and how much of it each namespace may claim."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from berth_operator import constants as c
from berth_operator.spec.fields import (
    Object,
    Report,
    Rule,
    String,
    array,
    integer,
    json_name,
    obj,
    optional,
    pass_through,
    quantity,
    read_object,
    spec_object,
    string,
    string_map,
)
from berth_operator.spec.formats import DNS1123_SUBDOMAIN, EXTENDED_RESOURCE
from berth_operator.spec.placement import Toleration
from berth_operator.spec.runtime import EnvVar, RuntimeArgs, _one_variable_each
from berth_operator.spec.status import Condition

# A pool counts one resource: an extended resource (nvidia.com/gpu, nvidia.com/mig-3g.40gb,
# amd.com/gpu) or, for CPU-only pools, whole CPU cores.
CPU_RESOURCE = "cpu"
ACCELERATOR_RESOURCE = rf"^({CPU_RESOURCE}|{EXTENDED_RESOURCE[1:-1]})$"
MAX_PER_RANK = 64
# What an admin may lock: the InferenceService may then not set it to anything else.
LOCKABLE = (
    "image",
    "env",
    "sharedMemory",
    "acceleratorsPerRank",
    "args",
    *(f"args.{json_name(f)}" for f in dataclasses.fields(RuntimeArgs)),
)
# The same rule on a set of namespaces, run by the API server at admission.
SOME_NAMESPACE = Rule(
    "(has(self.names) && size(self.names) > 0) "
    "|| (has(self.matchLabels) && size(self.matchLabels) > 0)",
    "name namespaces, or give matchLabels: an empty set selects no namespace",
)


@spec_object("The accelerator a rank of this pool gets.")
@dataclass(frozen=True)
class Accelerator:
    resource: str = string(
        "The resource each rank requests and the pool counts: an extended resource such as "
        "nvidia.com/gpu, nvidia.com/mig-3g.40gb or amd.com/gpu, or cpu (whole cores) for a "
        "CPU pool.",
        "nvidia.com/gpu",
        max_length=253,
        pattern=ACCELERATOR_RESOURCE,
        what="an extended resource name or cpu",
    )
    per_rank: int = integer(
        "How many of the resource each rank gets (an InferenceService may ask for another count "
        "in pools[].acceleratorsPerRank unless locked).",
        1,
        minimum=1,
        maximum=MAX_PER_RANK,
    )


@spec_object(
    "What ranks in this pool run with when their InferenceService leaves it unset. The "
    "InferenceService's own values win unless the field is listed in `locked`."
)
@dataclass(frozen=True)
class PoolDefaults:
    image: str | None = string("Runtime image for this hardware.", max_length=512, min_length=1)
    args: RuntimeArgs | None = optional(RuntimeArgs)
    env: tuple[dict[str, Any], ...] = array(
        "Environment variables for the runtime container (an InferenceService's variable of the "
        "same name wins unless env is locked).",
        EnvVar,
        max_items=64,
        map_keys=("name",),
        each=_one_variable_each,
    )
    shared_memory: str | None = quantity("Size of /dev/shm for each rank.")


@spec_object(
    "A set of namespaces: those named, and those whose labels include every matchLabels entry.",
    rules=(SOME_NAMESPACE,),
)
@dataclass(frozen=True)
class NamespaceSet:
    names: tuple[str, ...] = array(
        "Namespace names.",
        String("A namespace name.", max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"),
        max_items=256,
    )
    match_labels: tuple[tuple[str, str], ...] = string_map("Namespace labels, all required.")

    def check(self, report: Report) -> None:
        if not self.names and not self.match_labels:
            report(None, SOME_NAMESPACE.message)

    def matches(self, namespace: str, labels: Mapping[str, str]) -> bool:
        if namespace in self.names:
            return True
        return bool(self.match_labels) and all(labels.get(k) == v for k, v in self.match_labels)

    def describe(self) -> str:
        parts = [", ".join(self.names)] if self.names else []
        if self.match_labels:
            parts.append("labels " + ",".join(f"{k}={v}" for k, v in self.match_labels))
        return " or ".join(parts) or "no namespace"


@spec_object("At most this many accelerators for the namespaces selected.", rules=(SOME_NAMESPACE,))
@dataclass(frozen=True)
class NamespaceLimit(NamespaceSet):
    max_accelerators: int = integer(
        "The most accelerators the ranks of one such namespace may claim in this pool.",
        required=True,
        minimum=0,
    )


@spec_object("How much of the pool may be claimed, and by whom.")
@dataclass(frozen=True)
class PoolLimits:
    max_accelerators: int | None = integer(
        "The most accelerators all Berth ranks together may claim in this pool (default no limit).",
        minimum=0,
    )
    namespaces: tuple[NamespaceLimit, ...] = array(
        "Per-namespace maxima; a namespace takes the first entry that selects it (none: only the "
        "pool-wide maximum applies).",
        Object(NamespaceLimit),
        max_items=64,
    )
    allowed_namespaces: NamespaceSet | None = optional(NamespaceSet)

    def namespace_limit(self, namespace: str, labels: Mapping[str, str]) -> tuple[int, int] | None:
        """(index in `namespaces`, maximum) of the entry that selects the namespace, if any."""
        for i, limit in enumerate(self.namespaces):
            if limit.matches(namespace, labels):
                return i, limit.max_accelerators
        return None

    def allows(self, namespace: str, labels: Mapping[str, str]) -> bool:
        allowed = self.allowed_namespaces
        return allowed is None or allowed.matches(namespace, labels)


@spec_object("Where the ranks may run, beyond nodeSelector.")
@dataclass(frozen=True)
class PoolAffinity:
    node_affinity: dict[str, Any] | None = pass_through(
        "Node affinity for the ranks, as in a Pod spec; combined with an InferenceService's own "
        "node affinity so that both hold."
    )


@spec_object(
    "Where ranks of this pool run, what each gets and defaults to, and the limits on what Berth "
    "ranks may claim."
)
@dataclass(frozen=True)
class AcceleratorPoolSpec:
    accelerator: Accelerator = obj(Accelerator, schema_default=True)
    node_selector: tuple[tuple[str, str], ...] = string_map(
        "Node labels a rank's node must have (e.g. nvidia.com/gpu.product)."
    )
    affinity: PoolAffinity | None = optional(PoolAffinity)
    tolerations: tuple[dict[str, Any], ...] = array(
        "Taints the ranks tolerate (the pool's nodes are usually tainted for it).",
        Toleration,
        max_items=32,
    )
    priority_class_name: str | None = string(
        "PriorityClass of the ranks in this pool.",
        max_length=253,
        pattern=DNS1123_SUBDOMAIN,
        what="a PriorityClass name",
    )
    defaults: PoolDefaults = obj(PoolDefaults, schema_default=True)
    locked: tuple[str, ...] = array(
        "Fields an InferenceService may not set to anything but the pool's value: image, env, "
        "sharedMemory, acceleratorsPerRank, args (every flag) or args.<flag> (one).",
        String("A field name.", enum=LOCKABLE),
        max_items=32,
    )
    limits: PoolLimits = obj(PoolLimits, schema_default=True)

    @property
    def pod_affinity(self) -> dict[str, Any] | None:
        """The affinity as a Pod spec takes it."""
        if self.affinity is None or self.affinity.node_affinity is None:
            return None
        return {"nodeAffinity": self.affinity.node_affinity}

    def is_locked(self, field: str) -> bool:
        return field in self.locked or (field.startswith("args.") and "args" in self.locked)


@dataclass(frozen=True)
class AcceleratorPool:
    """One AcceleratorPool resource, parsed."""

    name: str
    spec: AcceleratorPoolSpec
    # The spec as written: defaults are merged from it, so that only what the admin set applies.
    raw_spec: Mapping[str, Any]
    uid: str | None = None
    generation: int | None = None

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> AcceleratorPool:
        from berth_operator.spec.service import SpecError

        problems: list[str] = []
        if body.get("kind") not in (None, c.POOL_KIND):
            problems.append(f"kind: expected {c.POOL_KIND}, got {body.get('kind')!r}")
        meta = body.get("metadata") or {}
        name = meta.get("name")
        if not isinstance(name, str) or not name:
            problems.append("metadata.name: required")
        spec = read_object(AcceleratorPoolSpec, body.get("spec"), "spec", problems)
        if problems or spec is None:
            raise SpecError(problems)
        return cls(
            name=name,
            spec=spec,
            raw_spec=body.get("spec") or {},
            uid=meta.get("uid"),
            generation=meta.get("generation"),
        )


# --- status --------------------------------------------------------------------------------------


@spec_object("Accelerators claimed by Berth ranks in one namespace.")
@dataclass(frozen=True)
class NamespaceUsage:
    namespace: str = string("The namespace.", required=True)
    claimed: int = integer("Accelerators its ranks claim.", required=True)
    limit: int | None = integer("Its maximum in this pool, if one applies.")


@spec_object("What the pool has and what Berth ranks claim of it; written by the operator only.")
@dataclass(frozen=True)
class AcceleratorPoolStatus:
    observed_generation: int | None = integer("The spec generation this describes.", format="int64")
    conditions: tuple[dict[str, Any], ...] = array(
        "NodesAvailable and OverCommitted, each with reason and message.",
        Condition,
        map_keys=("type",),
    )
    nodes: int | None = integer("Ready, schedulable Nodes that match the pool's placement.")
    allocatable: int | None = integer("The resource's allocatable total on those Nodes.")
    claimed: int | None = integer("Accelerators claimed by Berth ranks placed in the pool.")
    max_accelerators: int | None = integer("limits.maxAccelerators, for kubectl get.")
    namespaces: tuple[dict[str, Any], ...] = array(
        "Claims per namespace.", NamespaceUsage, map_keys=("namespace",)
    )
    services: tuple[str, ...] = array(
        "The InferenceServices placed in the pool, as namespace/name.",
        String("namespace/name."),
    )
