"""RankObserver: what the operator remembers of one InferenceService's ranks between scrapes,
and what it concludes from them (stalled ranks, imbalance, the autoscaler's rank count, the plan).

No I/O here: the handlers scrape, hand the samples in with the time, and carry out what comes back
(apply the plan, restart a pod, post the events). So every decision can be tested as a function
of real samples and a clock.
"""

from __future__ import annotations

import datetime
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from berth_operator import autoscale, health
from berth_operator.plan import RankPlan
from berth_operator.scrape import RankSample
from berth_operator.spec import InferenceService
from berth_operator.status import Live

# Samples older than the longest window any decision looks at (plus a margin) are dropped.
RETENTION_MARGIN_SECONDS = 30.0


@dataclass(frozen=True)
class Event:
    """Something users should see on the InferenceService (a Kubernetes Event)."""

    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass
class Stall:
    """A rank whose scheduler stopped making progress: from the scrape that saw it until the
    scheduler moves again or, once the operator has deleted its pod, until the replacement pod
    is ready. The rank stays withdrawn from routing, and Degraded names it, all that time."""

    pod: str
    uid: str
    since: float
    reason: str
    restart_requested: bool = False  # its pod was deleted: the StatefulSet brings a new one

    @property
    def state(self) -> str:
        return "Restarting" if self.restart_requested else "Stalled"

    def describe(self) -> str:
        if self.restart_requested:
            return (
                f"pod deleted after its scheduler stalled ({self.reason}); "
                "waiting for the new pod to be ready"
            )
        return self.reason


@dataclass
class RankObserver:
    """The windows of samples and the decisions of one InferenceService."""

    windows: dict[int, deque[RankSample]] = field(default_factory=dict)
    points: deque[autoscale.LoadPoint] = field(default_factory=deque)
    latest: dict[int, RankSample] = field(default_factory=dict)
    stalls: dict[int, Stall] = field(default_factory=dict)
    imbalance: str | None = None
    # The autoscaler's rank count (None: the spec's), and the rank it is draining to get there.
    desired: int | None = None
    draining: int | None = None
    last_scale_time: float | None = None
    last_scale_reason: str | None = None
    last_scale_message: str | None = None
    # The plan last applied to the cluster (None: not yet, by this process).
    applied: RankPlan | None = None
    retention: float = RETENTION_MARGIN_SECONDS

    @classmethod
    def from_status(cls, status: Mapping[str, Any] | None) -> RankObserver:
        """Resume the autoscaler's decisions from the status an earlier operator wrote."""
        status = status or {}
        scaler = status.get("autoscaler")
        if not isinstance(scaler, Mapping):
            return cls()
        desired = status.get("desiredReplicas")
        return cls(
            desired=desired if isinstance(desired, int) else None,
            draining=scaler.get("drainingRank"),
            last_scale_time=_parse_time(scaler.get("lastScaleTime")),
            last_scale_reason=scaler.get("reason"),
            last_scale_message=scaler.get("message"),
        )

    # --- the plan --------------------------------------------------------------------------

    def desired_ranks(self, isvc: InferenceService) -> int:
        """The ranks that should serve: the autoscaler's count within the bounds, or the spec's."""
        spec = isvc.spec
        if spec.autoscaling.enabled and self.desired is not None:
            bounds = spec.autoscaling
            return min(max(self.desired, bounds.min_replicas), bounds.max_replicas)
        return spec.ranks

    def plan(self, isvc: InferenceService) -> RankPlan:
        desired = self.desired_ranks(isvc)
        draining = self.draining if self.draining is not None and self.draining == desired else None
        pods = desired + 1 if draining is not None else desired
        withdrawn = {rank for rank in self.stalls if rank < pods}
        if draining is not None:
            withdrawn.add(draining)
        return RankPlan(pods, frozenset(withdrawn))

    # --- one scrape ------------------------------------------------------------------------

    def observe(
        self, isvc: InferenceService, samples: Sequence[RankSample], now: float
    ) -> list[Event]:
        """Take one round of samples; update health and scaling; return what to announce."""
        self._record(isvc, samples, now)
        events = self._judge_health(isvc, now)
        self._record_load(now)
        if isvc.spec.autoscaling.enabled:
            events += self._autoscale(isvc, now)
        else:
            self.desired = self.draining = None
        return events

    def restarts_due(self, isvc: InferenceService, now: float) -> list[Stall]:
        """Stalled ranks whose grace is over and whose pod was not restarted yet."""
        grace = isvc.spec.health.restart_after_seconds
        if grace <= 0:
            return []
        return [
            stall
            for stall in self.stalls.values()
            if not stall.restart_requested and now - stall.since >= grace
        ]

    def _record(self, isvc: InferenceService, samples: Sequence[RankSample], now: float) -> None:
        spec = isvc.spec
        retention = RETENTION_MARGIN_SECONDS + max(
            spec.health.stall_timeout_seconds,
            spec.health.imbalance_window_seconds,
            spec.autoscaling.scale_up_stabilization_seconds,
            spec.autoscaling.scale_down_delay_seconds,
        )
        seen = set()
        for sample in samples:
            seen.add(sample.rank)
            window = self.windows.setdefault(sample.rank, deque())
            if window and window[-1].uid != sample.uid:
                window.clear()  # a new pod for this rank: its counters start over
            window.append(sample)
            while window and window[0].time < now - retention:
                window.popleft()
        for rank in list(self.windows):
            if rank not in seen:  # the pod is gone
                del self.windows[rank]
        self.latest = {s.rank: s for s in samples}
        self.retention = retention

    def _record_load(self, now: float) -> None:
        """The service's load as the autoscaler sees it: the draining rank is on its way out, and
        a stalled rank's frozen numbers are no load that another rank could take."""
        answered = [s for s in self.latest.values() if s.ok and s.rank != self.draining]
        serving = [s for s in answered if s.rank not in self.stalls]
        self.points.append(
            autoscale.LoadPoint(
                time=now,
                ranks=len(answered),
                serving=len(serving),
                queued=sum(s.queued for s in serving),
                running=sum(s.running for s in serving),
                max_token_usage=max((s.token_usage for s in serving), default=0.0),
                total_token_usage=sum(s.token_usage for s in serving),
            )
        )
        while self.points and self.points[0].time < now - self.retention:
            self.points.popleft()

    def _judge_health(self, isvc: InferenceService, now: float) -> list[Event]:
        events = []
        timeout = isvc.spec.health.stall_timeout_seconds
        for rank, window in sorted(self.windows.items()):
            latest = window[-1]
            reason = health.stall_reason(window, timeout)
            stall = self.stalls.get(rank)
            if stall is not None and stall.uid != latest.uid:
                if stall.restart_requested and reason is None and not latest.serving:
                    continue  # the replacement of a restarted rank is still starting
                del self.stalls[rank]  # the pod was replaced: judge the new one afresh
                after = " after the restart" if stall.restart_requested else ""
                events.append(
                    Event("Normal", "RankReplaced", f"rank {rank}: new pod {latest.pod}{after}")
                )
                stall = None
            if reason is not None and stall is None:
                self.stalls[rank] = Stall(latest.pod, latest.uid, now, reason)
                events.append(
                    Event(
                        "Warning",
                        "SchedulerStalled",
                        f"rank {rank} ({latest.pod}): {reason}; withdrawn from routing",
                    )
                )
            elif reason is not None and stall is not None:
                stall.reason = reason
            elif reason is None and stall is not None:
                del self.stalls[rank]
                events.append(
                    Event(
                        "Normal",
                        "SchedulerRecovered",
                        f"rank {rank} ({latest.pod}) is making progress again; routed again",
                    )
                )
        ranks = self.desired_ranks(isvc)
        for rank, stall in list(self.stalls.items()):
            # A pod gone without the operator's restart takes its stall with it; a restarted
            # rank stays withdrawn and reported until its replacement serves (or is scaled away).
            if rank not in self.windows and not (stall.restart_requested and rank < ranks):
                del self.stalls[rank]
        imbalance = health.imbalance_reason(
            self.windows, now, isvc.spec.health.imbalance_window_seconds
        )
        if imbalance and not self.imbalance:
            events.append(Event("Warning", "RankImbalance", imbalance))
        self.imbalance = imbalance
        return events

    def _autoscale(self, isvc: InferenceService, now: float) -> list[Event]:
        policy = isvc.spec.autoscaling
        current = self.desired_ranks(isvc)
        events = []
        if self.draining is not None and self._drained(self.draining):
            events.append(
                Event("Normal", "RankDrained", f"rank {self.draining} finished its requests")
            )
            self.draining = None
        decision = autoscale.decide(
            list(self.points), current, policy, last_scale_time=self.last_scale_time, now=now
        )
        if decision is None:
            return events
        if decision.desired < current and self.draining is not None:
            return events  # one rank at a time: the last one is still finishing its requests
        if decision.desired < current:
            # Withdraw the top rank from routing first; its pod goes once it has drained.
            self.draining = decision.desired
        else:
            self.draining = None  # more load came back: the draining rank serves again
        self.desired = decision.desired
        self.last_scale_time = now
        self.last_scale_reason = decision.reason
        self.last_scale_message = decision.message
        events.append(
            Event(
                "Normal",
                "ScaledUp" if decision.desired > current else "ScaledDown",
                f"{current} -> {decision.desired} ranks: {decision.reason}: {decision.message}",
            )
        )
        return events

    def _drained(self, rank: int) -> bool:
        """The rank has nothing left to finish (or cannot be asked any more)."""
        sample = self.latest.get(rank)
        if sample is None or not sample.ok:
            return True
        return sample.idle

    # --- what the status shows ---------------------------------------------------------------

    def live(self, isvc: InferenceService) -> Live:
        plan = self.plan(isvc)
        ranks = []
        for rank in range(plan.pods):
            sample = self.latest.get(rank)
            entry: dict[str, Any] = {"rank": rank}
            stall = self.stalls.get(rank)
            if sample is None and stall is not None:  # its pod deleted by the operator
                entry.update(state=stall.state, ready=False, message=stall.describe())
                ranks.append(entry)
                continue
            if sample is None:
                entry.update(state="Starting", ready=False, message="no pod with an address yet")
                ranks.append(entry)
                continue
            entry.update(pod=sample.pod, ready=sample.ready)
            if sample.ok:
                entry.update(
                    queued=sample.queued,
                    running=sample.running,
                    tokenUsage=round(sample.token_usage, 4),
                    genThroughput=round(sample.gen_throughput, 1),
                    lastScrape=_rfc3339(sample.time),
                )
            if stall is not None:
                entry.update(state=stall.state, message=stall.describe())
            elif rank == self.draining:
                entry.update(state="Draining", message="being removed: finishing its requests")
            elif not sample.ok:
                entry.update(state="Unreachable", message=sample.error or "no answer")
            elif not sample.ready:
                phase = f" (server {sample.phase})" if sample.phase else ""
                entry.update(state="Starting", message=f"pod not ready{phase}")
            else:
                entry["state"] = "Serving"
            ranks.append(entry)
        answered = [s for s in self.latest.values() if s.ok]
        autoscaler = None
        if isvc.spec.autoscaling.enabled:
            autoscaler = {
                key: value
                for key, value in (
                    ("lastScaleTime", _rfc3339(self.last_scale_time)),
                    ("reason", self.last_scale_reason),
                    ("message", self.last_scale_message),
                    ("drainingRank", self.draining),
                )
                if value is not None
            }
        return Live(
            desired=self.desired_ranks(isvc),
            ranks=ranks,
            queued=sum(s.queued for s in answered),
            running=sum(s.running for s in answered),
            kv_usage=max((s.token_usage for s in answered), default=None),
            stalled={
                rank: f"rank {rank} ({s.pod}): {s.describe()}" for rank, s in self.stalls.items()
            },
            imbalance=self.imbalance,
            autoscaler=autoscaler,
        )


def _rfc3339(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    moment = datetime.datetime.fromtimestamp(timestamp, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        moment = datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return None
    return moment.replace(tzinfo=datetime.UTC).timestamp()
