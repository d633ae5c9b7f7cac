"""One InferenceService's worker: apply its children, retry, scrape its ranks and report its
status, one step at a time, from what the watches show.

kopf's watch streams feed each worker (`seen_service`, `seen_child`, `seen_pod`, called by the
handlers) with the InferenceService, its children and their pods, and wake it. The worker reads
nothing back from the API server for its status or for drift: a steady service costs no API
requests besides the watches, and the status is written only when it changes. (The one child
kind not watched, the InferencePool, whose CRD may be missing, is read when applying:
`inference_pool`.)

A step:

- parse the spec; an invalid one is reported once (condition and Event) and never retried;
- scrape the ranks when due (the observer decides stalls and scaling);
- apply the children when needed: a new generation (validated first), a child deleted or
  changed behind the operator's back (drift), a new rank plan, a due retry or the resync;
- publish the status computed from the children as last seen.

Failures: the API server failing is retried with backoff (1 s doubling to 60 s); a lost race
(409) at once; a refusal someone must act on (Forbidden, NameConflict) now and then (5 s
doubling to 5 min); an invalid spec or child not until the spec changes.

Over 400 lines because applying, retrying and observing share one state (what was applied, at
which versions, what failed and when to retry); it is one state machine, kept in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import kopf

from berth_operator import builders, children, k8s, metrics, naming, pool_placement, scrape, status
from berth_operator import constants as c
from berth_operator.children import ApplyFailure, ChildKey
from berth_operator.inference_pool import InferencePoolLink
from berth_operator.observer import Event, RankObserver
from berth_operator.plan import RankPlan, RankSet
from berth_operator.pool_placement import PlacementError, PoolView
from berth_operator.quota import Grant, Ledger
from berth_operator.spec import InferenceService, SpecError

logger = logging.getLogger(__name__)

RETRY_MIN_SECONDS = 1.0
RETRY_MAX_SECONDS = 60.0
BLOCKED_MIN_SECONDS = 5.0
BLOCKED_MAX_SECONDS = 300.0
MAX_AT_ONCE = 3
QUOTA_EXCEEDED = status.QUOTA_EXCEEDED
ERROR_PAUSE_SECONDS = 5.0


@dataclass
class Failure:
    """The last apply of `generation` failed; `retry_at` (monotonic) says when to try again."""

    error: ApplyFailure
    generation: int | None
    retry_at: float


@dataclass(frozen=True)
class Pools:
    """What placing services in AcceleratorPools needs: the cluster as watched, the ledger."""

    view: PoolView
    ledger: Ledger


@dataclass
class Worker:
    """What the operator knows and decides about one InferenceService."""

    namespace: str
    name: str
    kube: k8s.Kube
    default_image: str
    observe_interval: float
    router_image: str = c.DEFAULT_ROUTER_IMAGE
    body: dict[str, Any] | None = None
    children: dict[ChildKey, dict[str, Any]] = field(default_factory=dict)
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    observer: RankObserver = field(default_factory=RankObserver)
    # The children of the last apply, and the resourceVersions that apply left them at: a watch
    # event showing another version of a wanted child is drift.
    wanted: set[ChildKey] = field(default_factory=set)
    own_versions: dict[ChildKey, str] = field(default_factory=dict)
    deleted: set[ChildKey] = field(default_factory=set)  # wanted, seen deleted, not back yet
    drift: bool = False
    applied_generation: int | None = None
    failure: Failure | None = None
    backoff: float = 0.0
    at_once: int = 0
    scraped: bool = False
    next_scrape: float = 0.0
    next_resync: float = math.inf
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    # The operator's workers by (namespace, name): an idle worker removes itself when it ends.
    registry: dict[tuple[str, str], Worker] | None = None
    pools: Pools | None = None
    uses_pools: bool = False  # the spec lists pools: woken when pools, Nodes or claims change
    grant: Grant | None = None  # the last placement's quota decision
    rank_sets: tuple[RankSet, ...] = ()  # ... and where its ranks run (pools only)
    inference_pool: InferencePoolLink = field(default_factory=InferencePoolLink)

    # --- fed by the handlers -----------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self.task is not None

    def seen_service(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        if event_type == "DELETED":
            self.body = None
        else:
            uid = _uid(body)
            if self.body is not None and _uid(self.body) != uid:
                self._forget()  # deleted and created again under the same name
            self.body = _newer(self.body, dict(body))
            self.observer_from_status_once(body)
        self.wake.set()

    def seen_child(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        key = children.child_key(body)
        before = self.children.get(key)
        if event_type == "DELETED":
            if before is not None and _uid(before) == _uid(body):
                del self.children[key]
            if key in self.wanted:
                self.deleted.add(key)
                self.drift = True
                self.wake.set()
            return
        obj = dict(body)
        self.children[key] = obj
        self.deleted.discard(key)
        if event_type is None:
            return  # the initial listing: what exists, no change
        own = self.own_versions.get(key) == _version(obj)
        if not own and (
            before is None or _fingerprint(before) != _fingerprint(obj) or key not in self.wanted
        ):
            self.drift = True
        self.wake.set()

    def seen_pod(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        name = (body.get("metadata") or {}).get("name", "")
        if event_type == "DELETED":
            self.pods.pop(name, None)
        else:
            self.pods[name] = dict(body)
        self.wake.set()

    @property
    def idle(self) -> bool:
        """Nothing to keep: no InferenceService, no task, no children left."""
        return self.body is None and self.task is None and not self.children and not self.pods

    def observer_from_status_once(self, body: Mapping[str, Any]) -> None:
        """After an operator restart, the autoscaler resumes from the status it wrote."""
        if not self.started and self.applied_generation is None:
            self.observer = RankObserver.from_status(body.get("status"))

    def _forget(self) -> None:
        self.observer = RankObserver()
        self.wanted.clear()
        self.own_versions.clear()
        self.deleted.clear()
        self.applied_generation = None
        self.failure = None
        self.backoff = 0.0
        self.inference_pool = InferencePoolLink()

    # --- the task ------------------------------------------------------------------------------

    def start(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self.run(), name=f"berth:{self.namespace}/{self.name}")

    async def stop(self) -> None:
        task, self.task = self.task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def run(self) -> None:
        # Pod IPs are cluster-internal: never through an HTTP(S)_PROXY from the environment.
        try:
            async with httpx.AsyncClient(trust_env=False) as client:
                while self.body is not None:
                    try:
                        await self.step(client)
                    except asyncio.CancelledError:
                        raise
                    except Exception:  # the worker must outlive any one failure
                        logger.exception("Working on %s/%s failed", self.namespace, self.name)
                        await asyncio.sleep(ERROR_PAUSE_SECONDS)
                    await self._sleep()
        finally:
            metrics.forget(self.namespace, self.name)
            if self.pools is not None and self.body is None:
                self.pools.ledger.release((self.namespace, self.name))
            if self.task is asyncio.current_task():
                self.task = None
            key = (self.namespace, self.name)
            if self.idle and self.registry is not None and self.registry.get(key) is self:
                del self.registry[key]

    async def _sleep(self) -> None:
        now = time.monotonic()
        deadlines = [self.next_scrape, self.next_resync]
        if self.failure is not None:
            deadlines.append(self.failure.retry_at)
        timeout = max(0.0, min(deadlines) - now)
        if self.wake.is_set():
            await asyncio.sleep(0)  # let the handlers run between two steps, always
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=min(timeout, 3600.0))
        self.wake.clear()

    async def step(self, client: httpx.AsyncClient) -> None:
        body = self.body
        if body is None:
            return
        generation = (body.get("metadata") or {}).get("generation")
        try:
            isvc = InferenceService.from_body(
                body, default_image=self.default_image, router_image=self.router_image
            )
        except SpecError as e:
            self.next_scrape = time.monotonic() + self.observe_interval  # nothing to scrape
            if self.pools is not None:
                self.pools.ledger.stop_waiting((self.namespace, self.name))
            failure = self.failure
            if failure is None or failure.generation != generation:
                error = ApplyFailure(status.INVALID_SPEC, f"Invalid spec: {e}", retrying=False)
                await self._fail(error, generation, body)
            return
        now = time.monotonic()
        if now >= self.next_scrape:
            self.next_scrape = now + self.observe_interval
            await self._observe(isvc, client)
        plan = self.observer.plan(isvc)
        self.uses_pools = bool(isvc.spec.pools)
        if self.uses_pools:
            placed = await self._place(body, isvc, plan, generation)
            if placed is None:
                return  # refused: its status says why; running children stay as they are
            isvc, plan = placed
        elif self.pools is not None and self.grant is not None:
            self.pools.ledger.release((self.namespace, self.name))
            self.grant, self.rank_sets = None, ()
        if self.inference_pool.recheck_due(isvc, now) and await self.inference_pool.check(
            self.kube, now
        ):
            self.drift = True  # the InferencePool CRD was installed: create the pool now
        if self._apply_due(generation, plan, time.monotonic()):
            await self._reconcile(isvc, plan, generation)
        failure = self.failure
        if failure is not None and failure.generation == generation:
            return  # its status says why; running children stay as they are
        await self._refresh(isvc, plan)

    async def _place(
        self,
        body: Mapping[str, Any],
        isvc: InferenceService,
        plan: RankPlan,
        generation: int | None,
    ) -> tuple[InferenceService, RankPlan] | None:
        """The service placed in its first pool with room, and the plan cut to the ranks the
        pool's limits grant; None (after reporting why) when no listed pool can take it."""
        if self.pools is None:
            raise RuntimeError("pools are not set up")  # the handlers always set them up
        try:
            placement = pool_placement.place(
                body,
                isvc,
                self.pools.view,
                self.pools.ledger,
                plan.pods,
                default_image=self.default_image,
            )
        except PlacementError as e:
            failure = self.failure
            if (
                failure is None
                or failure.generation != generation
                or failure.error.message != e.message
            ):
                await self._fail(
                    ApplyFailure(e.reason, e.message, retrying=False), generation, body
                )
            return None
        if self.failure is not None and self.failure.error.reason in pool_placement.REASONS:
            self.failure = None  # a pool can take it now
        before, self.grant = self.grant, placement.grant
        self.rank_sets = placement.rank_sets
        grant = placement.grant
        if grant.short and (before is None or before.ranks != grant.ranks or not before.short):
            _post(body, "Warning", QUOTA_EXCEEDED, grant.limit or "")
        if not grant.short:
            return placement.isvc, plan
        clamped = RankPlan(grant.ranks, frozenset(r for r in plan.withdrawn if r < grant.ranks))
        return placement.isvc, clamped

    def _apply_due(self, generation: int | None, plan: RankPlan, now: float) -> bool:
        failure = self.failure
        if failure is not None and failure.generation == generation:
            return now >= failure.retry_at
        return (
            generation != self.applied_generation
            or self.drift
            or plan != self.observer.applied
            or now >= self.next_resync
        )

    # --- apply ---------------------------------------------------------------------------------

    async def _reconcile(
        self, isvc: InferenceService, plan: RankPlan, generation: int | None
    ) -> None:
        first = generation != self.applied_generation
        built = builders.build_children(isvc, plan, self.rank_sets if self.uses_pools else ())
        known = dict(self.children)
        try:
            built = await self.inference_pool.prepare(
                self.kube, isvc, built, known, time.monotonic()
            )
        except k8s.ApiError as e:
            error = ApplyFailure(
                status.APPLY_FAILED, f"reading the InferencePool: {e}", retrying=True
            )
            await self._fail(error, generation, self.body or {})
            return
        self.wanted = {children.child_key(child) for child in built}
        self.drift = False
        gone = set(self.deleted)  # (watch events keep coming in while the children are applied)
        try:
            result = await children.apply(
                self.kube, isvc, built, known, validate=first or self.failure is not None
            )
        except ApplyFailure as error:
            await self._fail(error, generation, self.body or {})
            return
        notice = self.inference_pool.applied(isvc)
        if notice is not None:
            _post(self.body or {}, notice.type, notice.reason, notice.message)
        self.own_versions.update(result.versions)
        repaired = [children.describe(k) for k in sorted(gone & set(result.versions))]
        self.deleted -= set(result.versions)
        self.applied_generation = generation
        self.observer.applied = plan
        self.failure = None
        self.backoff = 0.0
        self.at_once = 0
        self.next_resync = time.monotonic() + c.RESYNC_SECONDS
        body = self.body or {}
        if first:
            logger.info(
                "%s/%s: generation %s applied (%d children; pruned %s)",
                self.namespace,
                self.name,
                generation,
                len(built),
                [children.describe(k) for k in result.pruned] or "none",
            )
            _post(body, "Normal", "Applied", f"generation {generation}: {len(built)} children")
        if repaired and not first:
            _post(body, "Normal", "Restored", "re-created " + ", ".join(repaired))
        if result.restored:
            _post(body, "Normal", "Restored", "took back " + "; ".join(result.restored))
        if result.yielded:
            _post(body, "Normal", "LeftToOthers", "; ".join(result.yielded))
        if result.replaced:
            _post(
                body,
                "Normal",
                "Replaced",
                "re-created for an immutable field (pods kept): "
                + ", ".join(children.describe(k) for k in result.replaced),
            )

    async def _fail(
        self, error: ApplyFailure, generation: int | None, body: Mapping[str, Any]
    ) -> None:
        now = time.monotonic()
        if error.reason == children.NAMESPACE_TERMINATING:
            # The InferenceService goes with its namespace; its DELETED event ends this worker.
            self.failure = Failure(error, generation, math.inf)
            return
        if error.at_once and self.at_once < MAX_AT_ONCE:
            self.at_once += 1
            retry_at = now
        elif error.retrying:
            self.backoff = min(max(RETRY_MIN_SECONDS, self.backoff * 2), RETRY_MAX_SECONDS)
            retry_at = now + self.backoff
        elif error.reason == status.INVALID_SPEC:
            retry_at = math.inf
        else:
            self.backoff = min(max(BLOCKED_MIN_SECONDS, self.backoff * 2), BLOCKED_MAX_SECONDS)
            retry_at = now + self.backoff
        previous = self.failure
        self.failure = Failure(error, generation, retry_at)
        if (
            previous is None
            or previous.generation != generation
            or (previous.error.reason, previous.error.message) != (error.reason, error.message)
        ):
            logger.warning("%s/%s: %s", self.namespace, self.name, error)
            _post(body, "Warning", error.reason, error.message)
        current = body.get("status") or {}
        new = status.failed(
            error.reason,
            error.message,
            current,
            generation=generation,
            now=status.now_rfc3339(),
            retrying=error.retrying,
        )
        await self._publish(current, new)

    # --- observe and report ------------------------------------------------------------------

    async def _observe(self, isvc: InferenceService, client: httpx.AsyncClient) -> None:
        """One scrape of every rank; carry out what the observer decides (pod restarts, events);
        a new rank plan is applied by the step."""
        ranks = [
            pod
            for pod in self.pods.values()
            if ((pod.get("metadata") or {}).get("labels") or {}).get(c.LABEL_ROLE) == c.ROLE_RANK
        ]
        now = time.time()
        samples = await scrape.scrape_all(client, scrape.rank_targets(ranks), now)
        failures = sum(1 for sample in samples if not sample.ok)
        if failures:
            metrics.SCRAPE_ERRORS.labels(self.namespace, self.name).inc(failures)
        observer = self.observer
        events = observer.observe(isvc, samples, now)
        for stall in observer.restarts_due(isvc, now):
            # Gone already (False) counts too: the StatefulSet brings the replacement either way.
            await self.kube.delete(k8s.POD, self.namespace, stall.pod, uid=stall.uid)
            stall.restart_requested = True
            metrics.RANK_RESTARTS.labels(self.namespace, self.name).inc()
            events.append(
                Event(
                    "Warning",
                    "RankRestarted",
                    f"deleted {stall.pod}: stalled for {now - stall.since:.0f}s ({stall.reason})",
                )
            )
        self.scraped = True
        for event in events:
            if event.reason in ("ScaledUp", "ScaledDown"):
                direction = "up" if event.reason == "ScaledUp" else "down"
                metrics.SCALE_EVENTS.labels(self.namespace, self.name, direction).inc()
            elif event.reason == "SchedulerStalled":
                metrics.STALLS.labels(self.namespace, self.name).inc()
            _post(self.body or {}, event.type, event.reason, event.message)

    async def _refresh(self, isvc: InferenceService, plan: RankPlan) -> None:
        if self.applied_generation is None:
            return  # nothing applied by this process yet
        name = isvc.name
        spec = isvc.spec
        observed = status.Observed(
            statefulset=self.children.get(("StatefulSet", naming.rank_statefulset_name(name))),
            rank_sets=[
                (
                    self.children.get(("StatefulSet", naming.rank_statefulset_name(name, r.index))),
                    r.count,
                )
                for r in self.rank_sets
            ]
            if self.uses_pools
            else [],
            router=(
                self.children.get(("Deployment", naming.router_name(name)))
                if spec.has_router
                else None
            ),
            ingress=self.children.get(("Ingress", name)) if spec.ingress else None,
            pods=list(self.pods.values()),
        )
        live = self.observer.live(isvc) if self.scraped else None
        current = (self.body or {}).get("status") or {}
        new = status.compute(
            isvc,
            observed,
            current,
            generation=self.applied_generation,
            now=status.now_rfc3339(),
            plan=plan,
            live=live,
            missing=[children.describe(k) for k in sorted(self.deleted & self.wanted)],
            grant=self.grant if self.uses_pools else None,
            inference_pool=self.inference_pool.state,
        )
        await self._publish(current, new)
        if live is not None:
            metrics.record_live(self.namespace, self.name, live)

    async def _publish(self, current: Mapping[str, Any], new: Mapping[str, Any]) -> None:
        try:
            stored = await status.publish(self.kube, self.namespace, self.name, current, new)
        except k8s.ApiError as e:
            if e.status == 404:
                return  # the InferenceService is gone; its DELETED event ends this worker
            raise
        if stored is not None:
            self.body = _newer(self.body, stored)


def _post(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    if (body.get("metadata") or {}).get("uid"):
        kopf.event(body, type=type_, reason=reason, message=message)


def _uid(obj: Mapping[str, Any] | None) -> str | None:
    return ((obj or {}).get("metadata") or {}).get("uid")


def _version(obj: Mapping[str, Any]) -> str | None:
    return (obj.get("metadata") or {}).get("resourceVersion")


def _newer(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """The later of two versions of one object (a watch event may trail a write's answer).

    resourceVersions are opaque, but the API server's are etcd revisions: integers that grow.
    """
    if old is None or _uid(old) != _uid(new):
        return new
    try:
        return new if int(_version(new) or 0) >= int(_version(old) or 0) else old
    except ValueError:
        return new


def _fingerprint(obj: Mapping[str, Any]) -> str:
    """What a change of the child by someone else would change: its identity, generation (or,
    for kinds without one, its content), labels, annotations and owners. Status is left out."""
    meta = obj.get("metadata") or {}
    content: Any = meta.get("generation")
    if content is None:
        content = {k: v for k, v in obj.items() if k not in ("metadata", "status")}
    return json.dumps(
        [
            meta.get("uid"),
            content,
            meta.get("labels"),
            meta.get("annotations"),
            meta.get("ownerReferences"),
        ],
        sort_keys=True,
        default=str,
    )
