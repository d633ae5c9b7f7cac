"""RankObserver: health and scaling decisions from sequences of samples and a fake clock."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest

from berth_operator import observer as observer_module
from berth_operator import status
from berth_operator.observer import Event, RankObserver
from berth_operator.plan import RankPlan
from berth_operator.scrape import RankSample
from berth_operator.spec import InferenceService

from .factories import parse

BASE = 1_767_225_600.0  # 2026-01-01T00:00:00Z
STEP = 2


def rfc(seconds: float) -> str:
    """The RFC 3339 time of BASE + seconds (whole seconds)."""
    minutes, secs = divmod(int(seconds), 60)
    return f"2026-01-01T00:{minutes:02d}:{secs:02d}Z"


def sample(
    rank: int,
    t: float,
    *,
    heartbeat: float | None = None,
    queued: int = 0,
    running: int = 0,
    usage: float = 0.0,
    progress: bool = True,
    uid: str | None = None,
    ok: bool = True,
    ready: bool = True,
    error: str | None = None,
) -> RankSample:
    """Rank `rank` scraped at BASE + t. A live scheduler: the heartbeat follows the clock, and
    steps and tokens move with the clock (unless `progress` is False)."""
    now = BASE + t
    return RankSample(
        rank=rank,
        pod=f"chat-{rank}",
        uid=uid or f"uid-{rank}",
        time=now,
        ready=ready,
        ok=ok,
        error=error,
        queued=queued,
        running=running,
        token_usage=usage,
        gen_throughput=12.34 if running else 0.0,
        steps=t if progress else 7.0,
        generated_tokens=10 * t if progress else 70.0,
        heartbeat=now if heartbeat is None else heartbeat,
    )


Ranks = Callable[[float], Sequence[RankSample]]


class Run:
    """One InferenceService's observer, driven scrape by scrape."""

    def __init__(self, spec: dict[str, Any], observer: RankObserver | None = None) -> None:
        self.isvc: InferenceService = parse(spec)
        self.observer = observer or RankObserver()
        self.events: list[tuple[float, Event]] = []

    def tick(self, t: float, samples: Iterable[RankSample]) -> list[Event]:
        events = self.observer.observe(self.isvc, list(samples), BASE + t)
        self.events += [(t, e) for e in events]
        return events

    def over(self, start: float, end: float, ranks: Ranks) -> list[tuple[float, Event]]:
        """Scrape every STEP seconds from start to end (both included); the events."""
        seen = len(self.events)
        t = start
        while t <= end:
            self.tick(t, ranks(t))
            t += STEP
        return self.events[seen:]

    @property
    def plan(self) -> RankPlan:
        return self.observer.plan(self.isvc)

    def live_ranks(self) -> dict[int, dict[str, Any]]:
        return {entry["rank"]: dict(entry) for entry in self.observer.live(self.isvc).ranks}


def reasons(events: Iterable[tuple[float, Event]]) -> list[tuple[float, str]]:
    return [(t, e.reason) for t, e in events]


# --- health ------------------------------------------------------------------------------------

HEALTH: dict[str, Any] = {
    "replicas": 3,
    "health": {"stallTimeoutSeconds": 10, "restartAfterSeconds": 30, "imbalanceWindowSeconds": 20},
}
FROZEN = BASE - 5  # the heartbeat a stalled scheduler last sent


def rank1_frozen(t: float) -> list[RankSample]:
    return [sample(0, t), sample(1, t, heartbeat=FROZEN), sample(2, t)]


def stalled_run() -> Run:
    run = Run(HEALTH)
    run.over(0, 10, rank1_frozen)
    return run


def test_a_stalled_rank_is_reported_once_and_withdrawn() -> None:
    run = Run(HEALTH)
    events = run.over(0, 20, rank1_frozen)
    assert reasons(events) == [(10, "SchedulerStalled")]  # after stallTimeoutSeconds, once
    event = events[0][1]
    assert event.type == "Warning"
    assert event.message.startswith("rank 1 (chat-1): scheduler heartbeat has not moved for 10s")
    assert event.message.endswith("withdrawn from routing")
    assert run.plan == RankPlan(3, frozenset({1}))
    assert run.plan.routable == [0, 2]
    stall = run.observer.stalls[1]
    assert (stall.pod, stall.uid, stall.since) == ("chat-1", "uid-1", BASE + 10)
    live = run.observer.live(run.isvc)
    # The reason follows the stall as it lasts.
    assert live.stalled == {1: "rank 1 (chat-1): scheduler heartbeat has not moved for 20s"}
    entries = run.live_ranks()
    assert entries[1]["state"] == "Stalled"
    assert entries[1]["message"] == "scheduler heartbeat has not moved for 20s"
    assert entries[0]["state"] == entries[2]["state"] == "Serving"


def test_a_busy_rank_without_progress_is_stalled_though_its_heartbeat_moves() -> None:
    run = Run(HEALTH)
    events = run.over(
        0,
        12,
        lambda t: [sample(0, t, running=2, queued=1, progress=False), sample(1, t), sample(2, t)],
    )
    assert reasons(events) == [(10, "SchedulerStalled")]
    assert "no step and no token for 10s" in events[0][1].message
    assert run.plan.withdrawn == {0}


def test_a_stalled_rank_that_moves_again_is_routed_again() -> None:
    run = stalled_run()
    events = run.over(12, 14, lambda t: [sample(0, t), sample(1, t), sample(2, t)])
    assert reasons(events) == [(12, "SchedulerRecovered")]
    assert events[0][1].type == "Normal" and "rank 1 (chat-1)" in events[0][1].message
    assert run.plan == RankPlan(3)
    assert run.observer.live(run.isvc).stalled == {}
    assert run.live_ranks()[1]["state"] == "Serving"


def test_a_new_pod_for_a_stalled_rank_is_judged_afresh() -> None:
    run = stalled_run()

    # The replacement's heartbeat also stands still (it has not sent a new one yet): only its
    # own samples count, so it is not stalled before its own timeout.
    def replaced(t: float) -> list[RankSample]:
        return [sample(0, t), sample(1, t, heartbeat=BASE, uid="uid-1-new"), sample(2, t)]

    events = run.over(12, 20, replaced)
    assert reasons(events) == [(12, "RankReplaced")]
    assert events[0][1].message == "rank 1: new pod chat-1"
    assert run.plan == RankPlan(3)
    assert all(s.uid == "uid-1-new" for s in run.observer.windows[1])
    assert reasons(run.over(22, 22, replaced)) == [(22, "SchedulerStalled")]


def test_a_gone_pod_takes_its_stall_with_it() -> None:
    run = stalled_run()
    run.tick(12, [sample(0, 12), sample(2, 12)])  # chat-1 deleted, no address yet
    assert run.observer.stalls == {}
    assert run.plan == RankPlan(3)
    assert run.live_ranks()[1] == {
        "rank": 1,
        "state": "Starting",
        "ready": False,
        "message": "no pod with an address yet",
    }


def test_restarts_are_due_after_the_grace_and_only_once() -> None:
    run = stalled_run()  # stalled since BASE + 10, restartAfterSeconds 30
    assert run.observer.restarts_due(run.isvc, BASE + 39) == []
    (due,) = run.observer.restarts_due(run.isvc, BASE + 40)
    assert (due.pod, due.uid) == ("chat-1", "uid-1")
    assert "heartbeat" in due.reason
    due.restart_requested = True  # what the handler does when it deletes the pod
    assert run.observer.restarts_due(run.isvc, BASE + 1000) == []


def restarted_run() -> Run:
    """Rank 1 stalled, its pod deleted by the operator (what the worker does when it is due)."""
    run = stalled_run()
    (due,) = run.observer.restarts_due(run.isvc, BASE + 40)
    due.restart_requested = True
    return run


def test_a_restarted_rank_stays_withdrawn_and_reported_until_its_new_pod_is_ready() -> None:
    run = restarted_run()
    # The old pod is terminating (no scrape target), then its replacement starts, not ready.
    assert run.tick(42, [sample(0, 42), sample(2, 42)]) == []
    assert run.plan.withdrawn == {1}
    entry = run.live_ranks()[1]
    assert (entry["state"], entry["ready"]) == ("Restarting", False)
    assert entry["message"].startswith("pod deleted after its scheduler stalled (scheduler ")
    (message,) = run.observer.live(run.isvc).stalled.values()
    assert message.startswith("rank 1 (chat-1): pod deleted after its scheduler stalled")
    assert message.endswith("waiting for the new pod to be ready")

    def starting(t: float) -> list[RankSample]:
        new = sample(1, t, heartbeat=0.0, uid="uid-1-new", ready=False)
        return [sample(0, t), new, sample(2, t)]

    assert run.over(44, 60, starting) == []
    assert run.plan.withdrawn == {1}
    assert run.live_ranks()[1]["state"] == "Restarting"

    def serving(t: float) -> list[RankSample]:
        return [sample(0, t), sample(1, t, uid="uid-1-new"), sample(2, t)]

    events = run.over(62, 64, serving)
    assert reasons(events) == [(62, "RankReplaced")]
    assert events[0][1].message == "rank 1: new pod chat-1 after the restart"
    assert run.plan == RankPlan(3)
    assert run.observer.live(run.isvc).stalled == {}
    assert run.live_ranks()[1]["state"] == "Serving"


def test_a_restarted_rank_whose_new_pod_stalls_too_is_stalled_afresh() -> None:
    run = restarted_run()
    events = run.over(
        42, 60, lambda t: [sample(0, t), sample(1, t, heartbeat=BASE, uid="uid-1-new")]
    )
    assert reasons(events) == [(42, "RankReplaced"), (52, "SchedulerStalled")]
    stall = run.observer.stalls[1]
    assert (stall.uid, stall.restart_requested) == ("uid-1-new", False)


def test_a_restarted_rank_scaled_away_is_forgotten() -> None:
    run = restarted_run()
    run.isvc = parse({**HEALTH, "replicas": 1})
    run.tick(42, [sample(0, 42)])
    assert run.observer.stalls == {}
    assert run.plan == RankPlan(1)


def test_restart_after_zero_never_restarts() -> None:
    spec = {**HEALTH, "health": {**HEALTH["health"], "restartAfterSeconds": 0}}
    run = Run(spec)
    run.over(0, 10, rank1_frozen)
    assert run.observer.stalls  # withdrawn ...
    assert run.observer.restarts_due(run.isvc, BASE + 86_400) == []  # ... but never restarted


def test_imbalance_is_announced_once_and_cleared_when_balanced() -> None:
    run = Run(HEALTH)

    def hot(t: float) -> list[RankSample]:
        return [sample(0, t, queued=10, running=2), sample(1, t), sample(2, t, running=1)]

    events = run.over(0, 30, hot)
    assert reasons(events) == [(20, "RankImbalance")]  # once the window is covered
    assert events[0][1].type == "Warning"
    assert events[0][1].message.startswith("rank 0 averaged 10.0 queued requests over 20s")
    assert run.observer.live(run.isvc).imbalance == events[0][1].message
    assert run.observer.stalls == {}  # a long queue that moves is not a stall

    def even(t: float) -> list[RankSample]:
        return [sample(r, t, queued=10, running=2) for r in range(3)]

    assert run.over(32, 60, even) == []
    assert run.observer.imbalance is None
    assert run.observer.live(run.isvc).imbalance is None
    # Again once the even samples have mostly left the window: at 76 s the others average
    # 3 x 10 / 11 = 2.7 (10 >= 3 x 2.7); at 74 s still 4 x 10 / 11 = 3.6.
    assert reasons(run.over(62, 100, hot)) == [(76, "RankImbalance")]


def test_rank_states_in_the_live_view() -> None:
    run = Run(HEALTH)
    run.tick(
        0,
        [
            sample(0, 0, queued=2, running=3, usage=0.123456),
            sample(1, 0, ok=False, error="ConnectError: refused"),
            sample(2, 0, ready=False),
        ],
    )
    entries = run.live_ranks()
    assert entries[0] == {
        "rank": 0,
        "pod": "chat-0",
        "ready": True,
        "queued": 2,
        "running": 3,
        "tokenUsage": 0.1235,
        "genThroughput": 12.3,
        "lastScrape": rfc(0),
        "state": "Serving",
    }
    assert entries[1] == {
        "rank": 1,
        "pod": "chat-1",
        "ready": True,
        "state": "Unreachable",
        "message": "ConnectError: refused",
    }
    assert entries[2]["state"] == "Starting" and entries[2]["message"] == "pod not ready"
    live = run.observer.live(run.isvc)
    assert (live.queued, live.running, live.kv_usage) == (2, 3, 0.123456)
    assert live.desired == 3 and live.autoscaler is None


def test_no_answer_at_all_has_no_kv_usage() -> None:
    run = Run(HEALTH)
    run.tick(0, [sample(r, 0, ok=False) for r in range(3)])
    live = run.observer.live(run.isvc)
    assert (live.queued, live.running, live.kv_usage) == (0, 0, None)


def test_windows_do_not_grow_without_bound() -> None:
    run = Run(HEALTH)
    run.over(0, 2000, lambda t: [sample(r, t) for r in range(3)])
    retention = observer_module.RETENTION_MARGIN_SECONDS + 300  # the default scale-down delay
    assert len(run.observer.points) <= retention / STEP + 1
    assert all(len(w) <= retention / STEP + 1 for w in run.observer.windows.values())
    assert run.observer.points[0].time >= BASE + 2000 - retention


# --- autoscaling -------------------------------------------------------------------------------

AUTO: dict[str, Any] = {
    "replicas": 1,
    "autoscaling": {
        "enabled": True,
        "minReplicas": 1,
        "maxReplicas": 4,
        "targetQueuePerRank": 4,
        "tokenUsageCeiling": 0.8,
        "scaleUpStabilizationSeconds": 10,
        "scaleDownDelaySeconds": 60,
    },
    "health": {"stallTimeoutSeconds": 30, "restartAfterSeconds": 0},
}


def with_replicas(replicas: int, **autoscaling: Any) -> dict[str, Any]:
    return {**AUTO, "replicas": replicas, "autoscaling": {**AUTO["autoscaling"], **autoscaling}}


def idle(count: int) -> Ranks:
    return lambda t: [sample(r, t) for r in range(count)]


def test_a_sustained_queue_scales_up_and_no_further_while_the_new_ranks_start() -> None:
    run = Run(AUTO)
    events = run.over(0, 10, lambda t: [sample(0, t, queued=12, running=2)])
    assert reasons(events) == [(10, "ScaledUp")]
    assert events[0][1].message.startswith("1 -> 3 ranks: ScaleUp: 12.0 queued requests per rank")
    assert run.observer.desired == 3
    assert run.plan == RankPlan(3)
    live = run.observer.live(run.isvc)
    assert live.desired == 3
    assert live.autoscaler == {
        "lastScaleTime": rfc(10),
        "reason": "ScaleUp",
        "message": events[0][1].message.split(": ", 2)[2],
    }
    assert [e["state"] for e in live.ranks] == ["Serving", "Starting", "Starting"]
    # The new ranks take a minute to load; the queue stays on rank 0, but no second step.
    assert run.over(12, 70, lambda t: [sample(0, t, queued=12, running=2)]) == []
    assert run.observer.desired == 3


def test_scale_up_is_bounded_by_max_replicas() -> None:
    run = Run(AUTO)
    run.over(0, 10, lambda t: [sample(0, t, queued=100, running=2)])
    assert run.observer.desired == 4
    assert run.plan == RankPlan(4)


def draining_run(busy_until: float = 70) -> tuple[Run, Ranks]:
    """Three idle ranks, rank 2 finishing a long request until `busy_until`; scaled down to 2
    (draining rank 2) at 60 s. The run, and its ranks."""
    run = Run(with_replicas(3))

    def ranks(t: float) -> list[RankSample]:
        return [sample(0, t), sample(1, t), sample(2, t, running=1 if t <= busy_until else 0)]

    run.over(0, 60, ranks)
    return run, ranks


def test_idle_ranks_drain_the_top_rank_then_shrink() -> None:
    run, ranks = draining_run()
    assert reasons(run.events) == [(60, "ScaledDown")]
    assert run.events[0][1].message.startswith("3 -> 2 ranks: ScaleDown: no queued requests")
    assert run.observer.desired == 2 and run.observer.draining == 2
    # Withdrawn from routing, but its pod stays while it finishes its request.
    assert run.plan == RankPlan(3, frozenset({2}))
    live = run.observer.live(run.isvc)
    assert live.desired == 2
    assert live.autoscaler == {
        "lastScaleTime": rfc(60),
        "reason": "ScaleDown",
        "message": run.events[0][1].message.split(": ", 2)[2],
        "drainingRank": 2,
    }
    assert run.live_ranks()[2]["state"] == "Draining"
    assert run.over(62, 70, ranks) == []
    assert run.plan == RankPlan(3, frozenset({2}))
    # Its request is done: it drained, and the StatefulSet shrinks.
    events = run.over(72, 72, ranks)
    assert reasons(events) == [(72, "RankDrained")]
    assert events[0][1].message == "rank 2 finished its requests"
    assert run.observer.draining is None
    assert run.plan == RankPlan(2)
    assert "drainingRank" not in (run.observer.live(run.isvc).autoscaler or {})
    # The flapping guard: the next rank goes no sooner than the delay after the last change.
    assert run.over(74, 118, idle(2)) == []
    events = run.over(120, 120, idle(2))
    assert reasons(events) == [(120, "ScaledDown")]
    assert run.plan == RankPlan(2, frozenset({1}))


def test_a_draining_rank_that_stops_answering_counts_as_drained() -> None:
    run, ranks = draining_run()
    events = run.over(62, 62, lambda t: [sample(0, t), sample(1, t), sample(2, t, ok=False)])
    assert reasons(events) == [(62, "RankDrained")]
    assert run.plan == RankPlan(2)


def test_load_returning_during_a_drain_routes_the_rank_again() -> None:
    run, ranks = draining_run()

    def full(t: float) -> list[RankSample]:  # the fullest rank's KV cache over the ceiling
        return [sample(0, t, running=8, usage=0.9), sample(1, t), sample(2, t, running=1)]

    events = run.over(62, 72, full)
    assert reasons(events) == [(72, "ScaledUp")]
    assert events[0][1].message.startswith("2 -> 3 ranks")
    assert run.observer.draining is None and run.observer.desired == 3
    assert run.plan == RankPlan(3)
    assert run.live_ranks()[2]["state"] == "Serving"


def test_from_status_resumes_the_autoscaler() -> None:
    previous = {
        "desiredReplicas": 3,
        "autoscaler": {
            "lastScaleTime": rfc(50),
            "reason": "ScaleDown",
            "message": "no queued requests ...",
            "drainingRank": 3,
        },
    }
    run = Run(with_replicas(1), RankObserver.from_status(previous))
    assert run.observer.desired == 3 and run.observer.draining == 3
    assert run.observer.last_scale_time == BASE + 50
    # Before any scrape: the drain in progress is kept (rank 3 stays, withdrawn).
    assert run.plan == RankPlan(4, frozenset({3}))
    live = run.observer.live(run.isvc)
    assert live.desired == 3 and live.autoscaler == previous["autoscaler"]
    # Rank 3 is idle: drained at the first scrape. The resumed flapping guard holds the next
    # removal until 60 s after the resumed lastScaleTime, though the window is covered at 60.
    events = run.over(0, 108, lambda t: [sample(r, t) for r in range(4 if t == 0 else 3)])
    assert reasons(events) == [(0, "RankDrained")]
    assert reasons(run.over(110, 110, idle(3))) == [(110, "ScaledDown")]


@pytest.mark.parametrize(
    "previous",
    [
        None,
        {},
        {"desiredReplicas": 3},  # written with autoscaling off: nothing to resume
        {"autoscaler": "garbage", "desiredReplicas": 3},
    ],
)
def test_from_status_without_an_autoscaler_starts_fresh(previous: Any) -> None:
    observer = RankObserver.from_status(previous)
    assert (observer.desired, observer.draining, observer.last_scale_time) == (None, None, None)


def test_from_status_tolerates_bad_values() -> None:
    observer = RankObserver.from_status(
        {"desiredReplicas": "3", "autoscaler": {"lastScaleTime": "yesterday"}}
    )
    assert observer.desired is None and observer.last_scale_time is None


def test_the_status_written_resumes_the_same_decisions() -> None:
    run, ranks = draining_run()
    written = status.compute(
        run.isvc,
        status.Observed(),
        None,
        generation=1,
        now=rfc(61),
        plan=run.plan,
        live=run.observer.live(run.isvc),
    )
    resumed = RankObserver.from_status(written)
    assert resumed.desired == 2 and resumed.draining == 2
    assert resumed.last_scale_time == run.observer.last_scale_time
    assert resumed.last_scale_reason == "ScaleDown"
    assert resumed.plan(run.isvc) == run.plan


def test_disabled_autoscaling_follows_the_spec_and_forgets_the_decision() -> None:
    spec = {"replicas": 2, "autoscaling": {"enabled": False, "maxReplicas": 4}}
    run = Run(spec, RankObserver(desired=4, draining=3))
    events = run.over(0, 400, lambda t: [sample(0, t, queued=50, running=2), sample(1, t)])
    assert [e for e in events if e[1].reason.startswith("Scaled")] == []
    assert run.observer.desired is None and run.observer.draining is None
    assert run.plan == RankPlan(2)
    live = run.observer.live(run.isvc)
    assert live.desired == 2 and live.autoscaler is None


def test_bounds_apply_at_once_to_an_earlier_decision() -> None:
    observer = RankObserver(desired=4)
    assert observer.plan(parse(with_replicas(1, maxReplicas=2))) == RankPlan(2)
    assert observer.plan(parse(with_replicas(1, minReplicas=5, maxReplicas=6))) == RankPlan(5)
    assert observer.plan(parse(with_replicas(1))) == RankPlan(4)


def test_a_stale_drain_target_is_ignored() -> None:
    # A drain only means something while the count is the one it was decided for.
    observer = RankObserver(desired=3, draining=2)
    assert observer.plan(parse(with_replicas(1))) == RankPlan(3)


def test_stalls_beyond_the_plan_are_not_withdrawn() -> None:
    observer = RankObserver(desired=2)
    observer.stalls[5] = observer_module.Stall("chat-5", "u5", BASE, "frozen")
    observer.stalls[1] = observer_module.Stall("chat-1", "u1", BASE, "frozen")
    assert observer.plan(parse(with_replicas(1))) == RankPlan(2, frozenset({1}))


# --- known problems ----------------------------------------------------------------------------


def test_no_second_removal_while_a_rank_is_still_draining() -> None:
    run, ranks = draining_run(busy_until=1000)  # a long generation on rank 2
    events = run.over(62, 300, ranks)
    assert [r for _, r in reasons(events) if r == "ScaledDown"] == []  # one at a time
    assert run.observer.draining == 2
    assert run.plan == RankPlan(3, frozenset({2}))  # rank 2 keeps its pod until drained


def test_a_stalled_ranks_frozen_queue_does_not_scale_up() -> None:
    spec = with_replicas(2, maxReplicas=6)
    spec["health"] = {"stallTimeoutSeconds": 10, "restartAfterSeconds": 0}
    run = Run(spec)

    def ranks(t: float) -> list[RankSample]:
        stuck = sample(1, t, heartbeat=FROZEN, queued=20, running=2, progress=False)
        return [sample(0, t), stuck] + [sample(r, t) for r in range(2, run.plan.pods)]

    events = run.over(0, 120, ranks)
    assert (10, "SchedulerStalled") in reasons(events)
    assert [r for _, r in reasons(events) if r == "ScaledUp"] == []
