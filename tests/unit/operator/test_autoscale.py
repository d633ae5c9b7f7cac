"""The scaling policy: `decide` over windows of load points, with an explicit clock."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import pytest

from berth_operator import autoscale
from berth_operator.autoscale import SCALE_DOWN_HEADROOM, Decision, LoadPoint, decide
from berth_operator.spec import AutoscalingSpec

from .factories import parse

STEP = 5.0  # seconds between scrapes in these windows

POLICY = AutoscalingSpec(
    enabled=True,
    min_replicas=1,
    max_replicas=6,
    target_queue_per_rank=4.0,
    token_usage_ceiling=0.8,
    scale_up_stabilization_seconds=30,
    scale_down_delay_seconds=300,
)


def point(
    t: float,
    ranks: int,
    queued: int = 0,
    *,
    running: int = 0,
    usage: float = 0.0,
    total: float | None = None,
    serving: int | None = None,
) -> LoadPoint:
    return LoadPoint(
        time=t,
        ranks=ranks,
        serving=ranks if serving is None else serving,
        queued=queued,
        running=running,
        max_token_usage=usage,
        total_token_usage=usage * ranks if total is None else total,
    )


def steady(start: float, end: float, ranks: int, queued: int = 0, **kw: Any) -> list[LoadPoint]:
    """One point every STEP seconds from `start` to `end`, both included."""
    count = int((end - start) / STEP)
    return [point(start + i * STEP, ranks, queued, **kw) for i in range(count + 1)]


def run(
    points: Iterable[LoadPoint],
    current: int,
    policy: AutoscalingSpec = POLICY,
    *,
    now: float | None = None,
    last_scale_time: float | None = None,
) -> Decision | None:
    points = list(points)
    now = points[-1].time if now is None and points else (now or 0.0)
    return decide(points, current, policy, last_scale_time=last_scale_time, now=now)


def test_the_policy_is_the_parsed_spec() -> None:
    parsed = parse(
        {
            "autoscaling": {
                "enabled": True,
                "minReplicas": 1,
                "maxReplicas": 6,
                "targetQueuePerRank": 4,
                "tokenUsageCeiling": 0.8,
                "scaleUpStabilizationSeconds": 30,
                "scaleDownDelaySeconds": 300,
            }
        }
    ).spec.autoscaling
    assert parsed == POLICY


# --- bounds ------------------------------------------------------------------------------------


def test_below_minimum_goes_to_the_minimum_even_without_any_signal() -> None:
    policy = AutoscalingSpec(enabled=True, min_replicas=3, max_replicas=6)
    decision = run([], 1, policy, now=0.0)
    assert decision is not None
    assert decision.desired == 3
    assert decision.reason == autoscale.BELOW_MINIMUM
    assert "minReplicas (3)" in decision.message


def test_above_maximum_steps_down_one_rank_at_a_time_even_under_load() -> None:
    policy = AutoscalingSpec(enabled=True, min_replicas=1, max_replicas=2)
    busy = steady(0, 600, 5, queued=100)
    decision = run(busy, 5, policy)
    assert decision is not None
    assert (decision.desired, decision.reason) == (4, autoscale.ABOVE_MAXIMUM)
    assert "maxReplicas (2)" in decision.message
    assert run(busy, 3, policy).desired == 2  # type: ignore[union-attr]


def test_no_points_and_within_bounds_keeps_the_count() -> None:
    assert run([], 2, now=1000.0) is None


# --- scaling up ---------------------------------------------------------------------------------


def test_scale_up_waits_until_the_high_load_covers_the_stabilization_window() -> None:
    busy = steady(100, 125, 2, queued=20)
    # Seen for 25 s of the 30 required: not yet, however high.
    assert run(busy, 2, now=125) is None
    assert run(busy, 2, now=129.9) is None
    busy += [point(130, 2, 20)]
    decision = run(busy, 2, now=130)
    assert decision is not None
    assert decision.reason == autoscale.SCALE_UP
    assert decision.desired == 5  # ceil(20 / 4)


def test_one_calm_point_in_the_window_blocks_the_scale_up() -> None:
    points = steady(0, 60, 2, queued=20)
    calm = [p if p.time != 45 else point(45, 2, 8) for p in points]  # 4 per rank: not above
    assert run(calm, 2) is None
    # ... until the calm point leaves the window.
    later = calm + steady(65, 80, 2, queued=20)
    assert run(later, 2).desired == 5  # type: ignore[union-attr]


def test_high_load_before_the_window_does_not_count() -> None:
    points = steady(0, 100, 2, queued=50) + steady(105, 160, 2, queued=1)
    assert run(points, 2) is None


@pytest.mark.parametrize(
    ("queues", "current", "maximum", "desired"),
    [
        # The step covers the smallest queue of the window: ceil(30 / 4) = 8 ranks.
        ([40, 30, 35, 50, 45, 38, 31], 2, 10, 8),
        # ... capped at maxReplicas.
        ([40, 30, 35, 50, 45, 38, 31], 2, 6, 6),
        # Just above the target: one more rank.
        ([9, 9, 9, 9, 9, 9, 9], 2, 10, 3),
        ([13, 14, 13, 15, 13, 13, 13], 3, 10, 4),
    ],
)
def test_scale_up_step_covers_the_sustained_queue(
    queues: list[int], current: int, maximum: int, desired: int
) -> None:
    policy = AutoscalingSpec(
        enabled=True, min_replicas=1, max_replicas=maximum, scale_up_stabilization_seconds=30
    )
    points = [point(i * STEP, current, q) for i, q in enumerate(queues)]
    decision = run(points, current, policy)
    assert decision is not None
    assert decision.reason == autoscale.SCALE_UP
    assert decision.desired == desired
    assert decision.desired == min(maximum, max(current + 1, math.ceil(min(queues) / 4)))


def test_queue_exactly_at_the_target_is_not_high() -> None:
    assert run(steady(0, 60, 2, queued=8), 2) is None  # 4.0 per rank, target 4: not above


def test_kv_usage_above_the_ceiling_alone_adds_one_rank() -> None:
    points = steady(0, 60, 3, usage=0.81)
    decision = run(points, 3)
    assert decision is not None
    assert decision.desired == 4  # no queue: the step is the minimum, one rank
    assert decision.reason == autoscale.SCALE_UP
    assert "KV usage 81%" in decision.message and "ceiling 80%" in decision.message
    # At the ceiling is not above it.
    assert run(steady(0, 60, 3, usage=0.8), 3) is None


def test_zero_stabilization_scales_up_on_the_first_high_point() -> None:
    policy = AutoscalingSpec(enabled=True, max_replicas=4, scale_up_stabilization_seconds=0)
    assert run([point(7, 1, 9)], 1, policy).desired == 3  # type: ignore[union-attr]


def test_no_scale_up_at_the_maximum_and_no_scale_down_under_load() -> None:
    assert run(steady(0, 600, 6, queued=100, usage=0.95), 6) is None


def test_no_further_step_while_ranks_of_the_last_one_are_starting() -> None:
    # Scaled 2 -> 4: only 2 ranks answer, the whole queue is still on them.
    starting = steady(0, 300, 2, queued=40)
    assert run(starting, 4) is None
    # Full strength reached at t=305: the window counts from there, not from the old points.
    joined = starting + steady(305, 330, 4, queued=40)
    assert run(joined, 4) is None
    joined += [point(335, 4, 40)]
    assert run(joined, 4).desired == 6  # type: ignore[union-attr]


def test_a_rank_dropping_out_resets_the_window() -> None:
    points = steady(0, 60, 3, queued=30)
    points[-2] = point(55, 2, 30)  # one rank did not answer at this scrape
    assert run(points, 3) is None


# --- scaling down -------------------------------------------------------------------------------


def test_scale_down_after_the_delay_of_low_load_one_rank_at_a_time() -> None:
    idle = steady(0, 300, 4)
    assert run(idle, 4, now=299.9) is None  # the oldest point is not 300 s old yet
    decision = run(idle, 4, now=300)
    assert decision is not None
    assert decision.reason == autoscale.SCALE_DOWN
    assert decision.desired == 3  # not straight to the minimum
    assert "on 3 ranks for 300s" in decision.message


def test_flapping_guard_no_removal_within_the_delay_of_the_last_scale() -> None:
    idle = steady(0, 900, 4)
    assert run(idle, 4, last_scale_time=600.1) is None
    assert run(idle, 4, last_scale_time=600).desired == 3  # type: ignore[union-attr]


def test_never_below_the_minimum() -> None:
    policy = AutoscalingSpec(enabled=True, min_replicas=2, max_replicas=6)
    idle = steady(0, 3600, 2)
    assert run(idle, 2, policy) is None
    assert run(steady(0, 3600, 3), 3, policy).desired == 2  # type: ignore[union-attr]


def test_any_queue_in_the_window_blocks_the_scale_down() -> None:
    idle = steady(0, 600, 3)
    blip = [p if p.time != 500 else point(500, 3, 1) for p in idle]
    assert run(blip, 3) is None
    # A queue older than the window does not.
    assert run(blip + steady(605, 805, 3), 3).desired == 2  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("total", "scales_down"),
    [
        # On 2 remaining ranks: 1.1 / 2 = 0.55 < 0.7 * 0.8 = 0.56.
        (1.1, True),
        # 1.12 / 2 = 0.56: not under the headroom.
        (1.12, False),
        (1.5, False),
    ],
)
def test_scale_down_keeps_kv_headroom_on_the_remaining_ranks(
    total: float, scales_down: bool
) -> None:
    assert SCALE_DOWN_HEADROOM == 0.7
    points = steady(0, 300, 3, usage=0.5, total=total)
    decision = run(points, 3)
    assert (decision is not None and decision.desired == 2) is scales_down
    if decision is not None:
        assert decision.reason == autoscale.SCALE_DOWN


def test_running_requests_without_a_queue_still_allow_scale_down() -> None:
    points = steady(0, 300, 3, running=4, usage=0.2)
    assert run(points, 3).desired == 2  # type: ignore[union-attr]


# --- over time ---------------------------------------------------------------------------------


def simulate(
    load: list[tuple[int, float]], start: int, policy: AutoscalingSpec = POLICY
) -> list[tuple[float, Decision]]:
    """Scrape every STEP seconds and apply each decision at once; `load` gives, per scrape,
    (queued, fullest KV usage). Every rank answers (new ones at once)."""
    current = start
    last: float | None = None
    points: list[LoadPoint] = []
    decisions = []
    for i, (queued, usage) in enumerate(load):
        now = i * STEP
        points.append(point(now, current, queued, usage=usage))
        decision = decide(points, current, policy, last_scale_time=last, now=now)
        if decision is not None:
            decisions.append((now, decision))
            current, last = decision.desired, now
    return decisions


def test_flapping_load_never_scales_down() -> None:
    # High and idle on alternate scrapes for an hour: never sustained either way.
    load = [(40, 0.9) if i % 2 else (0, 0.0) for i in range(720)]
    assert simulate(load, 3) == []


def test_bursts_shorter_than_the_delay_scale_up_but_never_down() -> None:
    burst = [(40, 0.5)] * 8  # 40 s, longer than the 30 s stabilization
    lull = [(0, 0.0)] * 50  # 250 s, shorter than the 300 s delay
    decisions = simulate((burst + lull) * 8, 1)
    assert decisions, "the bursts must scale up"
    assert {d.reason for _, d in decisions} == {autoscale.SCALE_UP}
    assert decisions[-1][1].desired == 6


def test_sustained_load_then_idle_scales_up_fast_and_down_one_by_one() -> None:
    load = [(24, 0.5)] * 12 + [(0, 0.0)] * 400
    decisions = simulate(load, 1)
    up = [(t, d) for t, d in decisions if d.reason == autoscale.SCALE_UP]
    down = [(t, d) for t, d in decisions if d.reason == autoscale.SCALE_DOWN]
    assert [(t, d.desired) for t, d in up] == [(30.0, 6)]  # ceil(24 / 4), in one step
    assert [d.desired for _, d in down] == [5, 4, 3, 2, 1]
    times = [t for t, _ in decisions]
    assert all(later - earlier >= 300 for earlier, later in zip(times, times[1:], strict=False))
