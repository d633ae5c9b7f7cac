"""How many ranks run and when one is unhealthy: the autoscaling and health settings."""

from __future__ import annotations

from dataclasses import dataclass

from berth_operator.spec.fields import Report, Rule, boolean, integer, number, spec_object

MAX_REPLICAS = 64


@spec_object(
    "Scaling ranks on the schedulers' own signals (queued requests per rank, KV-cache usage), "
    "scraped from every rank by the operator. Up fast, down one drained rank at a time after a "
    "quiet window. The decision goes to the rank StatefulSet and status.desiredReplicas; the "
    "operator never writes the spec.",
    rules=(
        Rule(
            "!has(self.minReplicas) || !has(self.maxReplicas) "
            "|| self.minReplicas <= self.maxReplicas",
            "autoscaling.minReplicas must not exceed autoscaling.maxReplicas",
        ),
    ),
)
@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool = boolean("Turn autoscaling on.", False)
    min_replicas: int = integer("Fewest ranks.", 1, minimum=1, maximum=MAX_REPLICAS)
    max_replicas: int = integer("Most ranks.", 4, minimum=1, maximum=MAX_REPLICAS)
    target_queue_per_rank: float = number(
        "Queued requests per rank to aim for (sglang:num_queue_reqs).", 4.0, exclusive_minimum=0
    )
    token_usage_ceiling: float = number(
        "KV-cache usage (sglang:token_usage, 0-1) above which a rank counts as full.",
        0.85,
        exclusive_minimum=0,
        maximum=1,
    )
    scale_up_stabilization_seconds: int = integer(
        "How long the load must stay high before adding a rank.", 30, minimum=0, maximum=3600
    )
    scale_down_delay_seconds: int = integer(
        "How long the load must stay low before removing a rank.", 300, minimum=0, maximum=86400
    )

    def check(self, report: Report) -> None:
        if self.min_replicas > self.max_replicas:
            report(
                None,
                f"minReplicas ({self.min_replicas}) must not exceed maxReplicas "
                f"({self.max_replicas})",
            )


@spec_object(
    "When a rank counts as stalled (its process alive, its scheduler not), and what the operator "
    "does about it. The operator reads every rank's /metrics to decide."
)
@dataclass(frozen=True)
class HealthSpec:
    stall_timeout_seconds: int = integer(
        "A rank whose scheduler heartbeat stands still this long, or that has queued or running "
        "requests but generates no token and runs no step this long, is stalled: it is withdrawn "
        "from routing and the Degraded condition names it.",
        30,
        minimum=1,
        maximum=3600,
    )
    restart_after_seconds: int = integer(
        "How long a stalled rank may stay stalled before its pod is deleted (and recreated by its "
        "StatefulSet). 0 never restarts it.",
        120,
        minimum=0,
        maximum=86400,
    )
    imbalance_window_seconds: int = integer(
        "How long one rank's queue must stay far above the others' before the Degraded "
        "condition reports RankImbalance.",
        60,
        minimum=1,
        maximum=3600,
    )
