"""What each rank pod gets and where it runs: resources, parallelism, scheduling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from berth_operator.spec.fields import (
    Report,
    array,
    enum,
    integer,
    optional,
    pass_through,
    quantity,
    spec_object,
    string,
    string_map,
)
from berth_operator.spec.formats import DNS1123_SUBDOMAIN, EXTENDED_RESOURCE
from berth_operator.spec.runtime import RuntimeArgs

TOLERATION_OPERATORS = ("Exists", "Equal")
TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
WHEN_UNSATISFIABLE = ("DoNotSchedule", "ScheduleAnyway")


@spec_object(
    "Compute for each rank pod. Memory requests are also the limit unless memoryLimit is set."
)
@dataclass(frozen=True)
class ResourcesSpec:
    gpus: int = integer("GPUs per rank (0 = CPU only).", 0, minimum=0, maximum=16)
    gpu_resource: str = string(
        "The extended resource that counts GPUs on your nodes.",
        "nvidia.com/gpu",
        max_length=253,
        operator_pattern=EXTENDED_RESOURCE,
        what="a resource name",
    )
    cpu: str = quantity("CPU request per rank.", "1")
    memory: str = quantity(
        "Memory request per rank (and its limit unless memoryLimit is set).", "4Gi"
    )
    cpu_limit: str | None = quantity("CPU limit per rank (default none, so ranks may burst).")
    memory_limit: str | None = quantity("Memory limit per rank (default the memory request).")
    shared_memory: str = quantity(
        "Size of /dev/shm (a memory-backed emptyDir) for the runtime's processes (default 1Gi, "
        "or the pool's).",
        "1Gi",
        schema_default=False,  # unset, a pool's default applies
    )


@spec_object("How one rank spreads the model over devices.")
@dataclass(frozen=True)
class Parallelism:
    tensor: int = integer(
        "Tensor-parallel degree within a rank: the model split over this many processes, one "
        "per GPU (berth serve --tp-size). The rank pod requests this many GPUs unless "
        "resources.gpus says otherwise.",
        1,
        minimum=1,
        maximum=8,
    )


@spec_object("A Pod toleration.")
@dataclass(frozen=True)
class Toleration:
    key: str | None = string(
        "Taint key (empty with operator Exists matches every taint).", operator_max_length=253
    )
    operator: str | None = enum("Exists or Equal (default Equal).", TOLERATION_OPERATORS)
    value: str | None = string("Taint value to match with operator Equal.", operator_max_length=253)
    effect: str | None = enum("Taint effect to match (empty matches all).", TOLERATION_EFFECTS)
    toleration_seconds: int | None = integer(
        "For NoExecute, how long the pod stays bound after the taint appears."
    )


@spec_object(
    "A Pod topology spread constraint. The fields not listed here (labelSelector, minDomains, "
    "...) pass through as in a Pod spec, checked strictly by the API server when the operator "
    "applies the ranks.",
    preserve_unknown=True,
)
@dataclass(frozen=True)
class TopologySpreadConstraint:
    max_skew: int = integer(
        "How far the number of ranks may differ between topology domains.",
        required=True,
        minimum=1,
    )
    topology_key: str = string(
        "The node label whose values are the domains (e.g. topology.kubernetes.io/zone).",
        required=True,
        min_length=1,
        max_length=316,
    )
    when_unsatisfiable: str = enum(
        "DoNotSchedule or ScheduleAnyway.", WHEN_UNSATISFIABLE, required=True
    )


def _one_constraint_each(
    constraint: dict[str, Any], kept: list[dict[str, Any]], report: Report
) -> bool:
    keys = (constraint["topologyKey"], constraint["whenUnsatisfiable"])
    if any((c.get("topologyKey"), c.get("whenUnsatisfiable")) == keys for c in kept):
        report("topologyKey", f"duplicate entry for {keys[0]!r} and {keys[1]}: each pair once")
        return False
    return True


@spec_object("Where rank pods may run.")
@dataclass(frozen=True)
class SchedulingSpec:
    node_selector: tuple[tuple[str, str], ...] = string_map(
        "Node labels a rank's node must have (e.g. a GPU product label)."
    )
    tolerations: tuple[dict[str, Any], ...] = array(
        "Taints rank pods tolerate (e.g. nvidia.com/gpu:NoSchedule on GPU nodes).",
        Toleration,
        max_items=32,
    )
    affinity: dict[str, Any] | None = pass_through(
        "Pod affinity rules, as in a Pod spec; checked strictly by the API server when the "
        "operator applies the ranks (a misspelt key is an InvalidSpec)."
    )
    priority_class_name: str | None = string(
        "PriorityClass of rank pods.",
        max_length=253,
        operator_pattern=DNS1123_SUBDOMAIN,
        what="a PriorityClass name",
    )
    topology_spread_constraints: tuple[dict[str, Any], ...] = array(
        "How ranks spread over zones or nodes, as in a Pod spec: one constraint per topologyKey "
        "and whenUnsatisfiable.",
        TopologySpreadConstraint,
        max_items=8,
        map_keys=("topologyKey", "whenUnsatisfiable"),
        each=_one_constraint_each,
    )
    runtime_class_name: str | None = string(
        "RuntimeClass of rank pods (e.g. nvidia).",
        max_length=253,
        operator_pattern=DNS1123_SUBDOMAIN,
        what="a RuntimeClass name",
    )


@spec_object(
    "An AcceleratorPool the ranks may run in, and what changes there (its own rank set: a "
    "StatefulSet of consecutive ranks)."
)
@dataclass(frozen=True)
class PoolRef:
    name: str = string(
        "The AcceleratorPool's name.",
        required=True,
        max_length=253,
        pattern=DNS1123_SUBDOMAIN,
        what="an AcceleratorPool name",
    )
    accelerators_per_rank: int | None = integer(
        "Accelerators per rank in this pool (default the pool's accelerator.perRank).",
        minimum=1,
        maximum=64,
    )
    args: RuntimeArgs | None = optional(RuntimeArgs)
