"""Decide how many ranks to run from a window of the ranks' own load signals (pure).

The signals are the schedulers': queued requests per rank against `targetQueuePerRank`, and the
KV-cache usage of the fullest rank against `tokenUsageCeiling`. Scaling up is fast (the load only
has to stay high for `scaleUpStabilizationSeconds`, and the step covers the whole queue); scaling
down is slow and gentle (the load must stay low for `scaleDownDelaySeconds` since the last change,
the remaining ranks must keep headroom, and ranks go one at a time).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from berth_operator.spec import AutoscalingSpec

# A rank is removed only if the others would stay this far below the KV ceiling with its load.
SCALE_DOWN_HEADROOM = 0.7

SCALE_UP = "ScaleUp"
SCALE_DOWN = "ScaleDown"
BELOW_MINIMUM = "BelowMinimum"
ABOVE_MAXIMUM = "AboveMaximum"


@dataclass(frozen=True)
class LoadPoint:
    """The whole service's load at one scrape."""

    time: float
    ranks: int  # ranks whose metrics answered (a stalled rank answers too)
    serving: int  # of those, the ranks that are not stalled: the load below is theirs
    queued: int  # waiting requests, all serving ranks together
    running: int
    max_token_usage: float  # the fullest serving rank's KV usage, 0-1
    total_token_usage: float  # the sum over serving ranks, in units of one rank's KV cache

    @property
    def queue_per_rank(self) -> float:
        return self.queued / max(self.serving, 1)


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str
    message: str


def decide(
    points: Sequence[LoadPoint],
    current: int,
    policy: AutoscalingSpec,
    *,
    last_scale_time: float | None,
    now: float,
) -> Decision | None:
    """The new rank count, or None to keep `current`. `points` are oldest first."""
    if current < policy.min_replicas:
        return Decision(
            policy.min_replicas,
            BELOW_MINIMUM,
            f"{current} ranks is below autoscaling.minReplicas ({policy.min_replicas})",
        )
    if current > policy.max_replicas:
        return Decision(
            current - 1,
            ABOVE_MAXIMUM,
            f"{current} ranks is above autoscaling.maxReplicas ({policy.max_replicas})",
        )
    if not points:
        return None
    latest = points[-1]
    # Only the load seen since every rank of the current count answers: while the ranks of an
    # earlier scale-up are still starting, their share of the queue is still on the others, and
    # adding more ranks for it would overshoot.
    settled = _since_full_strength(points, current)
    up = _sustained(settled, now, policy.scale_up_stabilization_seconds)
    if up and current < policy.max_replicas and all(_high(p, policy) for p in up):
        sustained_queue = min(p.queued for p in up)
        by_queue = math.ceil(sustained_queue / policy.target_queue_per_rank)
        desired = min(policy.max_replicas, max(current + 1, by_queue))
        peak_usage = min(p.max_token_usage for p in up)
        return Decision(
            desired,
            SCALE_UP,
            f"{latest.queue_per_rank:.1f} queued requests per rank (target "
            f"{policy.target_queue_per_rank:g}), KV usage {peak_usage:.0%} (ceiling "
            f"{policy.token_usage_ceiling:.0%}) for "
            f"{policy.scale_up_stabilization_seconds}s",
        )
    if current <= policy.min_replicas:
        return None
    delay = policy.scale_down_delay_seconds
    if last_scale_time is not None and now - last_scale_time < delay:
        return None  # the flapping guard: no removal within the delay of any change
    down = _sustained(settled, now, delay)
    if down and all(_low(p, current, policy) for p in down):
        return Decision(
            current - 1,
            SCALE_DOWN,
            f"no queued requests and KV usage would stay under "
            f"{SCALE_DOWN_HEADROOM * policy.token_usage_ceiling:.0%} on {current - 1} ranks "
            f"for {delay}s",
        )
    return None


def _since_full_strength(points: Sequence[LoadPoint], current: int) -> list[LoadPoint]:
    """The trailing points in which at least `current` ranks answered."""
    start = len(points)
    while start > 0 and points[start - 1].ranks >= current:
        start -= 1
    return list(points[start:])


def _sustained(points: Sequence[LoadPoint], now: float, seconds: float) -> list[LoadPoint]:
    """The points of the last `seconds`, if the window is covered (some point is that old);
    otherwise nothing: a signal seen for a shorter time does not count yet."""
    start = now - seconds
    if not points or points[0].time > start:
        return []
    window = [p for p in points if p.time >= start]
    return window or [points[-1]]


def _high(point: LoadPoint, policy: AutoscalingSpec) -> bool:
    return (
        point.queue_per_rank > policy.target_queue_per_rank
        or point.max_token_usage > policy.token_usage_ceiling
    )


def _low(point: LoadPoint, current: int, policy: AutoscalingSpec) -> bool:
    remaining = current - 1
    return (
        point.queued == 0
        and point.total_token_usage / remaining < SCALE_DOWN_HEADROOM * policy.token_usage_ceiling
    )
