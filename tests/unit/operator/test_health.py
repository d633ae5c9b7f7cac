"""Rank health from windows of samples: stalled schedulers and imbalanced queues."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from berth_operator.health import (
    IMBALANCE_MIN_QUEUE,
    IMBALANCE_RATIO,
    imbalance_reason,
    stall_reason,
)
from berth_operator.scrape import RankSample

TIMEOUT = 30.0
STEP = 5.0


def sample(
    t: float,
    *,
    heartbeat: float | None = None,
    queued: int = 0,
    running: int = 0,
    steps: float = 0,
    tokens: float = 0,
    ok: bool = True,
    rank: int = 0,
) -> RankSample:
    """A scrape at `t`; the heartbeat follows the clock unless given."""
    return RankSample(
        rank=rank,
        pod=f"chat-{rank}",
        uid=f"uid-{rank}",
        time=t,
        ready=True,
        ok=ok,
        error=None if ok else "ConnectError: refused",
        queued=queued if ok else 0,
        running=running if ok else 0,
        steps=steps,
        generated_tokens=tokens,
        heartbeat=(1_000_000.0 + t if heartbeat is None else heartbeat) if ok else 0.0,
    )


def times(start: float, end: float) -> list[float]:
    return [start + i * STEP for i in range(int((end - start) / STEP) + 1)]


# --- stalls: the heartbeat ---------------------------------------------------------------------


def test_frozen_heartbeat_for_the_timeout_is_a_stall() -> None:
    frozen = [sample(t, heartbeat=123.5) for t in times(0, 30)]
    reason = stall_reason(frozen, TIMEOUT)
    assert reason is not None
    assert "heartbeat" in reason and "30s" in reason


def test_frozen_heartbeat_shorter_than_the_timeout_is_not_yet() -> None:
    frozen = [sample(t, heartbeat=123.5) for t in times(0, 25)]
    assert stall_reason(frozen, TIMEOUT) is None


def test_moving_heartbeat_is_not_a_stall() -> None:
    assert stall_reason([sample(t) for t in times(0, 300)], TIMEOUT) is None


def test_only_the_latest_unbroken_run_of_one_heartbeat_counts() -> None:
    # Frozen for a long time, then one move: the run starts again at the move.
    window = [sample(t, heartbeat=100.0) for t in times(0, 100)]
    window += [sample(t, heartbeat=200.0) for t in times(105, 130)]
    assert stall_reason(window, TIMEOUT) is None
    window.append(sample(135, heartbeat=200.0))
    reason = stall_reason(window, TIMEOUT)
    assert reason is not None and "30s" in reason
    # It moving again is a recovery at once.
    window.append(sample(140, heartbeat=201.0))
    assert stall_reason(window, TIMEOUT) is None


def test_a_heartbeat_that_was_never_reported_is_no_heartbeat_stall() -> None:
    # An older runtime (or one that has not sent its first heartbeat): 0 throughout.
    window = [sample(t, heartbeat=0.0) for t in times(0, 600)]
    assert stall_reason(window, TIMEOUT) is None


def test_failed_scrapes_are_ignored() -> None:
    frozen = [sample(t, heartbeat=42.0) for t in times(0, 30)]
    # Failed scrapes in between (heartbeat 0 in them) do not break the frozen run ...
    mixed = [x for s in frozen for x in (s, sample(s.time + 1, ok=False))]
    assert stall_reason(mixed, TIMEOUT) is not None
    # ... a failed latest scrape does not hide it ...
    assert stall_reason([*frozen, sample(40, ok=False)], TIMEOUT) is not None
    # ... and a rank that never answers is the readiness probe's business, not a stall.
    assert stall_reason([sample(t, ok=False) for t in times(0, 600)], TIMEOUT) is None
    assert stall_reason([], TIMEOUT) is None


# --- stalls: progress --------------------------------------------------------------------------


def test_busy_without_step_or_token_for_the_timeout_is_a_stall() -> None:
    # The heartbeat moves (the loop runs) but the batch makes no progress.
    window = [sample(t, running=2, queued=3, steps=50, tokens=900) for t in times(0, 30)]
    reason = stall_reason(window, TIMEOUT)
    assert reason is not None
    assert "2 running and 3 queued" in reason
    assert "no step and no token for 30s" in reason
    assert "heartbeat" not in reason
    assert stall_reason(window[:-1], TIMEOUT) is None  # 25 s: not yet


def test_busy_stall_is_detected_without_a_heartbeat_metric() -> None:
    window = [sample(t, heartbeat=0.0, queued=1, steps=7, tokens=3) for t in times(0, 60)]
    reason = stall_reason(window, TIMEOUT)
    assert reason is not None and "60s" in reason


@pytest.mark.parametrize("counter", ["steps", "tokens"])
def test_busy_with_progress_is_not_a_stall(counter: str) -> None:
    window = [
        sample(t, running=4, **{counter: 10 * i})  # type: ignore[arg-type]
        for i, t in enumerate(times(0, 300))
    ]
    assert stall_reason(window, TIMEOUT) is None


def test_an_idle_moment_restarts_the_busy_run() -> None:
    busy = [sample(t, running=1, steps=5) for t in times(0, 100)]
    idle = [sample(105, steps=5)]
    again = [sample(t, running=1, steps=5) for t in times(110, 135)]
    assert stall_reason(busy + idle + again, TIMEOUT) is None  # 25 s busy since the idle one
    assert stall_reason([*busy, *idle, *again, sample(140, running=1, steps=5)], TIMEOUT)


def test_idle_with_frozen_counters_and_a_moving_heartbeat_is_healthy() -> None:
    window = [sample(t, steps=99, tokens=1234) for t in times(0, 600)]
    assert stall_reason(window, TIMEOUT) is None


def test_the_timeout_is_honoured() -> None:
    frozen = [sample(t, heartbeat=5.0) for t in times(0, 60)]
    assert stall_reason(frozen, 60) is not None
    assert stall_reason(frozen, 61) is None


# --- imbalance ---------------------------------------------------------------------------------

WINDOW = 60.0


def windows(queues: dict[int, Sequence[int]], start: float = 0.0) -> dict[int, list[RankSample]]:
    """Per rank, one sample every STEP seconds from `start` with the given queues."""
    return {
        rank: [sample(start + i * STEP, rank=rank, queued=q) for i, q in enumerate(qs)]
        for rank, qs in queues.items()
    }


def flat(value: int, count: int = 13) -> list[int]:
    return [value] * count  # 13 samples: 0..60 s


def test_one_long_queue_is_imbalance_naming_the_rank() -> None:
    reason = imbalance_reason(windows({0: flat(1), 1: flat(10), 2: flat(0)}), 60, WINDOW)
    assert reason is not None
    assert reason.startswith("rank 1 averaged 10.0 queued requests over 60s")
    assert "the other ranks 0.5" in reason


def test_balanced_queues_are_not_imbalance() -> None:
    assert imbalance_reason(windows({0: flat(12), 1: flat(10), 2: flat(11)}), 60, WINDOW) is None


@pytest.mark.parametrize(
    ("worst", "others", "flagged"),
    [
        (6.0, 2.0, True),  # exactly IMBALANCE_RATIO x the others
        (5.5, 2.0, False),
        (4.0, 0.0, True),  # the others count as at least one
        (3.5, 0.0, False),  # below IMBALANCE_MIN_QUEUE
        (9.0, 3.0, True),
        (8.5, 3.0, False),
    ],
)
def test_imbalance_thresholds(worst: float, others: float, flagged: bool) -> None:
    assert IMBALANCE_MIN_QUEUE == 4.0 and IMBALANCE_RATIO == 3.0

    def alternating(mean: float) -> list[int]:
        return [math.floor(mean), math.ceil(mean)] * 6  # 12 samples, 0..55 s

    ranks = windows({0: alternating(others), 1: alternating(worst)})
    reason = imbalance_reason(ranks, 55, 55)
    assert (reason is not None) is flagged
    if flagged:
        assert reason is not None and reason.startswith(f"rank 1 averaged {worst:.1f}")


def test_a_rank_not_observed_for_the_whole_window_does_not_take_part() -> None:
    queues = windows({0: flat(10)})
    queues[1] = [sample(10 + i * STEP, rank=1, queued=0) for i in range(11)]  # since 10 s
    assert imbalance_reason(queues, 60, WINDOW) is None
    # A third rank that was there all along: now two ranks compare.
    queues[2] = windows({2: flat(0)})[2]
    reason = imbalance_reason(queues, 60, WINDOW)
    assert reason is not None and reason.startswith("rank 0")


def test_one_rank_alone_is_never_imbalanced() -> None:
    assert imbalance_reason(windows({0: flat(100)}), 60, WINDOW) is None
    assert imbalance_reason({}, 60, WINDOW) is None


def test_only_the_window_counts() -> None:
    # Rank 1 was hot long ago; over the last 60 s all are equal.
    old = windows({0: [0] * 30, 1: [50] * 17 + [0] * 13})  # 0..145 s, rank 1 hot until 80 s
    assert imbalance_reason(old, 145, WINDOW) is None
    assert imbalance_reason(old, 85, WINDOW) is not None  # its hot samples in this window


def test_failed_scrapes_are_left_out_of_the_means() -> None:
    ranks = windows({0: flat(0), 1: flat(6)})
    # Rank 1's failed scrapes would halve its mean if they counted as empty queues.
    ranks[1] = [x for s in ranks[1] for x in (s, sample(s.time + 1, rank=1, ok=False))]
    assert imbalance_reason(ranks, 60, WINDOW) is not None
    # A rank that never answers does not take part at all.
    only_failed = {0: ranks[0], 2: [sample(t, rank=2, ok=False) for t in times(0, 60)]}
    assert imbalance_reason(only_failed, 60, WINDOW) is None
