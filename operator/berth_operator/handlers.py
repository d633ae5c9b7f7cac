"""kopf handlers: parse the spec, build the children, apply them, report status from their state;
and one task per InferenceService that scrapes its ranks and carries out what the observer decides.

Each handler is thin; the logic lives in `spec` (parse), `builders` (manifests), `k8s` (API calls),
`status` (conditions), `scrape` (rank metrics) and `observer` (health and scaling decisions).
Importing this module registers the handlers with kopf.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import kopf

from berth_operator import builders, k8s, metrics, scrape, settings, status
from berth_operator import constants as c
from berth_operator.observer import Event, RankObserver
from berth_operator.spec import InferenceService, SpecError

__all__ = ["settings"]  # imported for its @kopf.on.startup handler

logger = logging.getLogger(__name__)  # the rank watcher's (kopf's per-object loggers post Events)
CHILD_FILTER = {c.LABEL_MANAGED_BY: c.MANAGED_BY, c.LABEL_ISVC: kopf.PRESENT}
APPLY_RETRY_SECONDS = 30


@kopf.on.login()
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """kopf and the operator's own client share one set of credentials."""
    return memo.kube.connection_info()


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    for service in memo.services.values():
        await service.stop_watching()
    memo.kube.close()


@kopf.on.resume(c.GROUP, c.VERSION, c.PLURAL)
@kopf.on.create(c.GROUP, c.VERSION, c.PLURAL)
@kopf.on.update(c.GROUP, c.VERSION, c.PLURAL, field="spec")
async def reconcile(
    body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """Bring the children in line with the spec: all of them, or (on a bad spec) none of them."""
    kube: k8s.Kube = memo.kube
    generation = body.metadata.get("generation")
    service = _service(memo, namespace, name, body.get("status"))
    service.watch(memo, namespace, name)
    async with service.lock:
        try:
            isvc = InferenceService.from_body(body, default_image=memo.default_image)
        except SpecError as e:
            await _fail(kube, body, status.INVALID_SPEC, f"Invalid spec: {e}")
            raise kopf.PermanentError(f"invalid spec: {e}") from e

        plan = service.observer.plan(isvc)
        children = builders.build_children(isvc, plan)
        try:
            pruned = await _apply(kube, isvc, children)
            service.observer.applied = plan
        except k8s.ApiError as e:
            if e.invalid:
                message = f"Invalid spec: the API server rejected a child: {e.message}"
                await _fail(kube, body, status.INVALID_SPEC, message)
                raise kopf.PermanentError(message) from e
            await _fail(kube, body, status.APPLY_FAILED, f"Applying the children failed: {e}")
            raise kopf.TemporaryError(str(e), delay=APPLY_RETRY_SECONDS) from e

        logger.info("Applied %d children (pruned %s).", len(children), pruned or "none")
        kopf.event(
            body,
            type="Normal",
            reason="Applied",
            message=f"generation {generation}: {len(children)} children applied",
        )
        await _refresh(kube, memo, namespace, name, applied_generation=generation)


@kopf.on.event("apps", "v1", "statefulsets", labels=CHILD_FILTER)
@kopf.on.event("apps", "v1", "deployments", labels=CHILD_FILTER)
@kopf.on.event("networking.k8s.io", "v1", "ingresses", labels=CHILD_FILTER)
@kopf.on.event("v1", "pods", labels=CHILD_FILTER)
async def child_changed(
    labels: kopf.Labels, namespace: str, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """A child changed: recompute its InferenceService's status from what the children show."""
    owner = labels[c.LABEL_ISVC]
    service = _service(memo, namespace, owner)
    if service.queued:
        return  # a refresh that starts after this event is already waiting: it will see it
    service.queued = True
    try:
        async with service.lock:
            service.queued = False
            await _refresh(memo.kube, memo, namespace, owner)
    except k8s.ApiError as e:
        if e.status == 404:
            return  # the InferenceService went away meanwhile: nothing to report on
        logger.warning("Could not refresh the status of %s/%s: %s", namespace, owner, e)
    finally:
        service.queued = False


@kopf.on.delete(c.GROUP, c.VERSION, c.PLURAL, optional=True)
async def forget(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """Children go by garbage collection (owner references); only drop our in-memory state.

    Without a finalizer this may not run at all; the rank watcher also ends by itself when it
    finds the InferenceService gone.
    """
    service = memo.services.pop((namespace, name), None)
    if service is not None:
        await service.stop_watching()
    metrics.forget(namespace, name)


@dataclass
class _Service:
    """The operator's in-memory state for one InferenceService."""

    observer: RankObserver
    # Serializes applies and status writes (reconcile, child events, the rank watcher).
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    queued: bool = False
    scraped: bool = False  # the watcher has scraped the ranks at least once
    task: asyncio.Task[None] | None = None

    def watch(self, memo: kopf.Memo, namespace: str, name: str) -> None:
        """Start the rank watcher unless it runs already."""
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(
                _watch_ranks(memo, self, namespace, name),
                name=f"berth-watch-ranks:{namespace}/{name}",
            )

    async def stop_watching(self) -> None:
        task, self.task = self.task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _service(memo: kopf.Memo, namespace: str, name: str, current_status: Any = None) -> _Service:
    key = (namespace, name)
    if key not in memo.services:
        memo.services[key] = _Service(RankObserver.from_status(current_status))
    return memo.services[key]


async def _apply(
    kube: k8s.Kube, isvc: InferenceService, children: list[dict[str, Any]]
) -> list[tuple[str, str]]:
    """Apply every child, then delete the owned children no longer wanted."""
    # The API server validates every child first (schemas, admission): a spec it would
    # reject halfway through must not leave half of the children applied.
    for child in children:
        await kube.apply(child, dry_run=True)
    for child in children:
        await kube.apply(child)
    return await kube.prune(isvc.namespace, builders.owned_labels(isvc.name), isvc.uid, children)


async def _watch_ranks(memo: kopf.Memo, service: _Service, namespace: str, name: str) -> None:
    """Every `memo.observe_interval` seconds: scrape the ranks and act on what they show,
    until the InferenceService is gone. A failed round is logged; the next one runs anyway."""
    # Pod IPs are cluster-internal: never through an HTTP(S)_PROXY from the environment.
    async with httpx.AsyncClient(trust_env=False) as client:
        while True:
            try:
                if not await _observe_ranks(memo, service, namespace, name, client):
                    break
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001  (the watcher must outlive any one failure)
                logger.warning("Watching the ranks of %s/%s failed: %r", namespace, name, e)
            await asyncio.sleep(memo.observe_interval)
    if memo.services.get((namespace, name)) is service:
        del memo.services[(namespace, name)]
    metrics.forget(namespace, name)


async def _observe_ranks(
    memo: kopf.Memo, service: _Service, namespace: str, name: str, client: httpx.AsyncClient
) -> bool:
    """One round: scrape, decide, carry it out, report. False: the InferenceService is gone."""
    kube: k8s.Kube = memo.kube
    body = await kube.get(k8s.INFERENCESERVICE, namespace, name)
    if body is None:
        return False
    try:
        isvc = InferenceService.from_body(body, default_image=memo.default_image)
    except SpecError:
        return True  # the reconcile reports it; nothing to observe until it is fixed
    pods = await kube.list(k8s.POD, namespace, builders.selector_labels(name, c.ROLE_RANK))
    now = time.time()
    samples = await scrape.scrape_all(client, scrape.rank_targets(pods), now)
    failures = sum(1 for sample in samples if not sample.ok)
    if failures:
        metrics.SCRAPE_ERRORS.labels(namespace, name).inc(failures)

    observer = service.observer
    events = observer.observe(isvc, samples, now)
    for stall in observer.restarts_due(isvc, now):
        stall.restart_requested = True
        await kube.delete(k8s.POD, namespace, stall.pod, uid=stall.uid)
        metrics.RANK_RESTARTS.labels(namespace, name).inc()
        events.append(
            Event(
                "Warning",
                "RankRestarted",
                f"deleted {stall.pod}: stalled for {now - stall.since:.0f}s ({stall.reason})",
            )
        )

    async with service.lock:
        # Read again under the lock: a reconcile may have applied a newer spec while we scraped,
        # and children built from the older one must not be applied over it.
        fresh = await kube.get(k8s.INFERENCESERVICE, namespace, name)
        if fresh is None:
            return False
        current = fresh.get("status") or {}
        generation = (fresh.get("metadata") or {}).get("generation")
        settled = (
            generation == (body.get("metadata") or {}).get("generation")
            and current.get("observedGeneration") == generation
            and not status.sticky_failure(current, generation)
        )
        plan = observer.plan(isvc)
        # A generation the reconcile has not applied (or could not) is the reconcile's to apply.
        if settled and plan != observer.applied:
            await _apply(kube, isvc, builders.build_children(isvc, plan))
            observer.applied = plan
        service.scraped = True
        await _refresh(kube, memo, namespace, name)

    live = observer.live(isvc)
    metrics.record_live(namespace, name, live)
    for event in events:
        if event.reason in ("ScaledUp", "ScaledDown"):
            direction = "up" if event.reason == "ScaledUp" else "down"
            metrics.SCALE_EVENTS.labels(namespace, name, direction).inc()
        elif event.reason == "SchedulerStalled":
            metrics.STALLS.labels(namespace, name).inc()
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    return True


async def _refresh(
    kube: k8s.Kube,
    memo: kopf.Memo,
    namespace: str,
    name: str,
    *,
    applied_generation: int | None = None,
) -> None:
    """Read the resource and its children; publish the status they imply (if it changed)."""
    body = await kube.get(k8s.INFERENCESERVICE, namespace, name)
    if body is None:
        return
    current = body.get("status") or {}
    generation = body.get("metadata", {}).get("generation")
    if applied_generation is None:
        # The status describes the last applied generation. A newer spec awaits its reconcile,
        # and a generation that failed to apply keeps its failure until a newer one succeeds.
        if current.get("observedGeneration") != generation:
            return
        if status.sticky_failure(current, generation):
            return
    else:
        generation = applied_generation
    try:
        isvc = InferenceService.from_body(body, default_image=memo.default_image)
    except SpecError:
        return  # the reconcile of this generation reports it
    spec = isvc.spec
    observed = status.Observed(
        statefulset=await kube.get(
            k8s.STATEFULSET, namespace, builders.rank_statefulset_name(name)
        ),
        router=(
            await kube.get(k8s.DEPLOYMENT, namespace, builders.router_name(name))
            if spec.has_router
            else None
        ),
        ingress=await kube.get(k8s.INGRESS, namespace, name) if spec.ingress else None,
        pods=await kube.list(k8s.POD, namespace, builders.owned_labels(name)),
    )
    service = _service(memo, namespace, name)
    live = service.observer.live(isvc) if service.scraped else None
    new = status.compute(
        isvc,
        observed,
        current,
        generation=generation,
        now=status.now_rfc3339(),
        plan=service.observer.plan(isvc),
        live=live,
    )
    await status.publish(kube, namespace, name, current, new)


async def _fail(kube: k8s.Kube, body: kopf.Body, reason: str, message: str) -> None:
    """Report a generation that cannot be applied: Ready=False with the reason, and an Event."""
    kopf.warn(body, reason=reason, message=message)
    namespace, name = body.metadata.namespace, body.metadata.name
    current = await kube.get(k8s.INFERENCESERVICE, namespace, name)
    previous = (current or {}).get("status") or {}
    new = status.failed(
        reason,
        message,
        previous,
        generation=body.metadata.get("generation"),
        now=status.now_rfc3339(),
    )
    await status.publish(kube, namespace, name, previous, new)
