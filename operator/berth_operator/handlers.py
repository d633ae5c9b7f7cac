"""kopf handlers: parse the spec, build the children, apply them, report status from their state.

Each handler is thin; the logic lives in `spec` (parse), `builders` (manifests), `k8s` (API calls)
and `status` (conditions). Importing this module registers the handlers with kopf.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import kopf

from berth_operator import builders, k8s, settings, status
from berth_operator import constants as c
from berth_operator.spec import InferenceService, SpecError

__all__ = ["settings"]  # imported for its @kopf.on.startup handler

CHILD_FILTER = {c.LABEL_MANAGED_BY: c.MANAGED_BY, c.LABEL_ISVC: kopf.PRESENT}
APPLY_RETRY_SECONDS = 30


@kopf.on.login()
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """kopf and the operator's own client share one set of credentials."""
    return memo.kube.connection_info()


@kopf.on.cleanup()
def close(memo: kopf.Memo, **_: Any) -> None:
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
    async with _refresher(memo, namespace, name).lock:
        try:
            isvc = InferenceService.from_body(body, default_image=memo.default_image)
        except SpecError as e:
            await _fail(kube, body, status.INVALID_SPEC, f"Invalid spec: {e}")
            raise kopf.PermanentError(f"invalid spec: {e}") from e

        children = builders.build_children(isvc)
        try:
            # The API server validates every child first (schemas, admission): a spec it would
            # reject halfway through must not leave half of the children applied.
            for child in children:
                await kube.apply(child, dry_run=True)
            for child in children:
                await kube.apply(child)
            pruned = await kube.prune(namespace, builders.owned_labels(name), isvc.uid, children)
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
    refresher = _refresher(memo, namespace, owner)
    if refresher.queued:
        return  # a refresh that starts after this event is already waiting: it will see it
    refresher.queued = True
    try:
        async with refresher.lock:
            refresher.queued = False
            await _refresh(memo.kube, memo, namespace, owner)
    except k8s.ApiError as e:
        if e.status == 404:
            return  # the InferenceService went away meanwhile: nothing to report on
        logger.warning("Could not refresh the status of %s/%s: %s", namespace, owner, e)
    finally:
        refresher.queued = False


@kopf.on.delete(c.GROUP, c.VERSION, c.PLURAL, optional=True)
def forget(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """Children go by garbage collection (owner references); only drop our in-memory state."""
    memo.refreshes.pop((namespace, name), None)


@dataclass
class _Refresher:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    queued: bool = False


def _refresher(memo: kopf.Memo, namespace: str, name: str) -> _Refresher:
    return memo.refreshes.setdefault((namespace, name), _Refresher())


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
    new = status.compute(isvc, observed, current, generation=generation, now=status.now_rfc3339())
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
