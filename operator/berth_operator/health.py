"""Judge rank health from windows of scraped samples: stalled schedulers and queue imbalance (pure).

A rank's HTTP server can answer while its scheduler is frozen (a deadlock, a stuck kernel, a
SIGSTOP): Kubernetes' probes see a live pod. The scheduler's own counters tell the truth: its
heartbeat timestamp moves every half second while its loop runs, and its step and generated-token
counters move whenever it has work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from statistics import fmean

from berth_operator.scrape import RankSample

# A queue counts as imbalanced when the longest one averages at least this many requests ...
IMBALANCE_MIN_QUEUE = 4.0
# ... and this many times the average of the other ranks' queues (which count as at least 1).
IMBALANCE_RATIO = 3.0


def stall_reason(samples: Sequence[RankSample], timeout: float) -> str | None:
    """Why this rank is stalled, or None. `samples` are one pod's, oldest first."""
    answered = [s for s in samples if s.ok]
    if not answered:
        return None  # not answering at all is the readiness probe's business, not a stall
    latest = answered[-1]
    if latest.heartbeat > 0:
        # The oldest sample of the unbroken run that shows the same heartbeat as the latest one.
        since = latest
        for sample in reversed(answered):
            if sample.heartbeat != latest.heartbeat:
                break
            since = sample
        if latest.time - since.time >= timeout:
            return f"scheduler heartbeat has not moved for {latest.time - since.time:.0f}s"
    if latest.busy:
        since = latest
        for sample in reversed(answered):
            if (
                not sample.busy
                or sample.generated_tokens != latest.generated_tokens
                or sample.steps != latest.steps
            ):
                break
            since = sample
        if latest.time - since.time >= timeout:
            return (
                f"{latest.running} running and {latest.queued} queued requests, but no step "
                f"and no token for {latest.time - since.time:.0f}s"
            )
    return None


def imbalance_reason(
    windows: Mapping[int, Sequence[RankSample]], now: float, window: float
) -> str | None:
    """Why the ranks' queues are imbalanced over the last `window` seconds, or None.

    Only ranks observed for the whole window take part, so a rank that just started (with an
    empty queue) does not make the others look imbalanced.
    """
    start = now - window
    means: dict[int, float] = {}
    for rank, samples in windows.items():
        answered = [s for s in samples if s.ok]
        if not answered or answered[0].time > start:
            continue
        recent = [s.queued for s in answered if s.time >= start]
        if recent:
            means[rank] = fmean(recent)
    if len(means) < 2:
        return None
    worst = max(means, key=lambda rank: means[rank])
    others = fmean(q for rank, q in means.items() if rank != worst)
    if means[worst] >= IMBALANCE_MIN_QUEUE and means[worst] >= IMBALANCE_RATIO * max(others, 1.0):
        return (
            f"rank {worst} averaged {means[worst]:.1f} queued requests over {window:.0f}s, "
            f"the other ranks {others:.1f}: check the routing policy and routing keys"
        )
    return None
