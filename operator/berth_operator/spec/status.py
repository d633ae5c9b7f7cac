"""InferenceServiceStatus: the schema of what the operator reports (`berth_operator.status`
computes it; nothing reads it back as a spec)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from berth_operator.spec.fields import (
    array,
    boolean,
    enum,
    integer,
    number,
    optional,
    spec_object,
    string,
)

RANK_STATES = ("Serving", "Starting", "Unreachable", "Stalled", "Draining")


@spec_object("A condition (metav1.Condition).")
@dataclass(frozen=True)
class Condition:
    type: str = string("Ready, Reconciling, Stalled or Degraded.", required=True, max_length=316)
    status: str = enum("True, False or Unknown.", ("True", "False", "Unknown"), required=True)
    reason: str | None = string(
        "A CamelCase word for why (e.g. InvalidSpec, RanksNotReady, PodsFailing).",
        max_length=1024,
    )
    message: str | None = string("What is going on, for a person.", max_length=32768)
    observed_generation: int | None = integer(
        "The metadata.generation this condition was computed for.", format="int64"
    )
    last_transition_time: str | None = string("When the status last changed.", format="date-time")


@spec_object("One data-parallel rank.")
@dataclass(frozen=True)
class RankStatus:
    rank: int = integer("The DP rank (the pod's ordinal).", required=True)
    pod: str | None = string("The rank's pod.")
    state: str | None = enum(
        "Serving, Starting (not ready yet), Unreachable (metrics not answering), Stalled "
        "(scheduler frozen: withdrawn from routing) or Draining (being removed by the "
        "autoscaler: no new requests).",
        RANK_STATES,
    )
    ready: bool | None = boolean("Whether the pod is ready.")
    queued: int | None = integer("Requests waiting (sglang:num_queue_reqs).")
    running: int | None = integer("Requests being generated (sglang:num_running_reqs).")
    token_usage: float | None = number(
        "Fraction of the rank's KV cache in use (sglang:token_usage, 0-1)."
    )
    gen_throughput: float | None = number("Output tokens per second (sglang:gen_throughput).")
    last_scrape: str | None = string(
        "The scrape that last changed this entry (the status is written only when something in "
        "it changes, not after every scrape).",
        format="date-time",
    )
    message: str | None = string("Why the rank is not Serving, for a person.")


@spec_object("The autoscaler's last decision (present while spec.autoscaling.enabled).")
@dataclass(frozen=True)
class AutoscalerStatus:
    last_scale_time: str | None = string("When the rank count last changed.", format="date-time")
    reason: str | None = string("Why (ScaleUp, ScaleDown, BelowMinimum, AboveMaximum).")
    message: str | None = string("The signals behind the decision, for a person.")
    draining_rank: int | None = integer(
        "The rank being drained before removal (withdrawn from routing, finishing its requests)."
    )


@spec_object("Ranks in one AcceleratorPool.")
@dataclass(frozen=True)
class PoolUse:
    pool: str = string("The pool.", required=True)
    ranks: int = integer("Ranks placed in it (running or starting).", required=True)


@spec_object("What the operator observed; written by the operator only.")
@dataclass(frozen=True)
class InferenceServiceStatus:
    observed_generation: int | None = integer(
        "The metadata.generation of the spec this status describes.", format="int64"
    )
    conditions: tuple[dict[str, Any], ...] = array(
        "Ready, Reconciling, Stalled (kstatus' conditions) and Degraded, each with reason, "
        "message and observedGeneration.",
        Condition,
        map_keys=("type",),
    )
    url: str | None = string("OpenAI-compatible base URL (through the Ingress when there is one).")
    cluster_url: str | None = string(
        "In-cluster OpenAI-compatible base URL of the entry Service.", json="clusterURL"
    )
    replicas: int | None = integer("Rank pods that exist.")
    ready_replicas: int | None = integer("Rank pods that are ready.")
    desired_replicas: int | None = integer(
        "Ranks that should serve now (spec.replicas, or the autoscaler's decision while "
        "autoscaling is enabled)."
    )
    ready_ranks: str | None = string("readyReplicas/desiredReplicas, for kubectl get.")
    router_ready_replicas: int | None = integer("Router pods that are ready.")
    queued_requests: int | None = integer(
        "Requests waiting across all ranks (sglang:num_queue_reqs), from the ranks' metrics."
    )
    running_requests: int | None = integer(
        "Requests being generated across all ranks (sglang:num_running_reqs), from the ranks' "
        "metrics."
    )
    kv_usage: str | None = string(
        "KV-cache usage of the fullest rank (sglang:token_usage) as a percentage, for kubectl get."
    )
    ranks: tuple[dict[str, Any], ...] = array(
        "Each rank's live state, from its last scrape (every few seconds).",
        RankStatus,
        map_keys=("rank",),
    )
    autoscaler: AutoscalerStatus | None = optional(AutoscalerStatus)
    selector: str | None = string("Label selector of the rank pods (for the scale subresource).")
    pools: tuple[dict[str, Any], ...] = array(
        "The AcceleratorPools the ranks run in, in rank order (when spec.pools is set).",
        PoolUse,
    )
