"""kopf handlers: hand what the watches show to each InferenceService's worker.

Every handler records one event and wakes the worker (`worker.Worker`), which applies, retries,
scrapes and reports. They are all `@kopf.on.event` handlers: kopf keeps no state of its own on the
objects (no progress or diff-base annotations, no finalizers), so the operator writes nothing on
an InferenceService but its status. Importing this module registers the handlers with kopf.

Why each worker is an asyncio task of ours and not a `@kopf.daemon` or `@kopf.timer`: kopf
registers both with `requires_finalizer=True` (kopf/on.py), so every InferenceService would carry
kopf's finalizer. Deleting one would then hang for as long as the operator is down or lacks rights,
`kubectl delete` and Argo CD prunes would wait on it, and the operator would need update rights on
InferenceServices themselves, not only on their status. Children are owned by the InferenceService
and go with it through garbage collection, so there is nothing a finalizer would protect. The
worker's lifecycle is the daemon's without the finalizer: started on the first event for its
object, ended by its DELETED event (`Worker.seen_service`) and stopped at cleanup (`close`).
"""

from __future__ import annotations

from typing import Any

import kopf

from berth_operator import constants as c
from berth_operator import pools, settings
from berth_operator.worker import Worker

__all__ = ["pools", "settings"]  # imported for their handlers

# Children and their pods, selected by the API server (settings.py) and checked again here.
CHILD_FILTER = {c.LABEL_MANAGED_BY: c.MANAGED_BY, c.LABEL_ISVC: kopf.PRESENT}


@kopf.on.login()
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """kopf and the operator's own client share one set of credentials."""
    return memo.kube.connection_info()


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    for worker in list(memo.workers.values()):
        await worker.stop()
    await memo.pool_reporter.stop()
    await memo.kube.close()


@kopf.on.event(c.GROUP, c.VERSION, c.PLURAL)
async def inference_service(
    type: str | None, body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, **kwargs: Any
) -> None:
    """An InferenceService appeared, changed or went: its worker takes it from here."""
    pools.bind(memo, kwargs)
    worker = _worker(memo, namespace, name)
    worker.seen_service(type, body)
    if worker.body is not None:
        worker.start()
    elif worker.task is None:
        _drop_if_idle(memo, worker)


@kopf.index("apps", "v1", "statefulsets", labels=CHILD_FILTER)
@kopf.index("apps", "v1", "deployments", labels=CHILD_FILTER)
@kopf.index("v1", "services", labels=CHILD_FILTER)
@kopf.index("policy", "v1", "poddisruptionbudgets", labels=CHILD_FILTER)
@kopf.index("networking.k8s.io", "v1", "ingresses", labels=CHILD_FILTER)
@kopf.index("v1", "serviceaccounts", labels=CHILD_FILTER)
@kopf.index("rbac.authorization.k8s.io", "v1", "rolebindings", labels=CHILD_FILTER)
@kopf.index("v1", "pods", labels=CHILD_FILTER)
def listed(**_: Any) -> None:
    """Indexes nothing. Being an index, it makes kopf hold every handler back until these kinds
    are fully listed: after a (re)start, no worker acts on a half-read cluster (a rank pod not yet
    seen would read as gone, and the status would be written twice for nothing)."""
    return None


@kopf.on.event(c.GROUP, c.VERSION, c.POOL_PLURAL)
@kopf.on.event("", "v1", "nodes")
@kopf.on.event("", "v1", "namespaces")
async def pool_inputs(memo: kopf.Memo, **kwargs: Any) -> None:
    """A pool, a Node or a namespace changed: pools' status, and services placed by them."""
    pools.bind(memo, kwargs)
    pools.changed(memo)


@kopf.on.event("apps", "v1", "statefulsets", labels=CHILD_FILTER)
@kopf.on.event("apps", "v1", "deployments", labels=CHILD_FILTER)
@kopf.on.event("v1", "services", labels=CHILD_FILTER)
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=CHILD_FILTER)
@kopf.on.event("networking.k8s.io", "v1", "ingresses", labels=CHILD_FILTER)
@kopf.on.event("v1", "serviceaccounts", labels=CHILD_FILTER)
@kopf.on.event("rbac.authorization.k8s.io", "v1", "rolebindings", labels=CHILD_FILTER)
async def child(
    type: str | None,
    body: kopf.Body,
    labels: kopf.Labels,
    namespace: str,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """A child changed: its state feeds the status; a change by someone else is drift."""
    if body.get("kind") == "StatefulSet":
        pools.changed(memo)  # a claim on a pool may have moved (or left its pool)
    worker = _worker_of(memo, namespace, labels, type)
    if worker is not None:
        worker.seen_child(type, body)
        _drop_if_idle(memo, worker)


@kopf.on.event("v1", "pods", labels=CHILD_FILTER)
async def pod(
    type: str | None,
    body: kopf.Body,
    labels: kopf.Labels,
    namespace: str,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """A rank or router pod changed: readiness, failures and the addresses to scrape."""
    worker = _worker_of(memo, namespace, labels, type)
    if worker is not None:
        worker.seen_pod(type, body)
        _drop_if_idle(memo, worker)


def _worker(memo: kopf.Memo, namespace: str, name: str) -> Worker:
    key = (namespace, name)
    if key not in memo.workers:
        memo.workers[key] = Worker(
            namespace,
            name,
            kube=memo.kube,
            default_image=memo.default_image,
            router_image=memo.router_image,
            observe_interval=memo.observe_interval,
            registry=memo.workers,
            pools=memo.pools,
        )
    return memo.workers[key]


def _worker_of(
    memo: kopf.Memo, namespace: str, labels: kopf.Labels, event_type: str | None
) -> Worker | None:
    """The worker of the object's InferenceService; none for the deletion of an unknown one's
    child (the garbage collector clearing up after a deleted InferenceService)."""
    owner = labels.get(c.LABEL_ISVC)
    if not owner:
        return None
    if event_type == "DELETED" and (namespace, owner) not in memo.workers:
        return None
    return _worker(memo, namespace, owner)


def _drop_if_idle(memo: kopf.Memo, worker: Worker) -> None:
    if worker.idle and memo.workers.get((worker.namespace, worker.name)) is worker:
        del memo.workers[(worker.namespace, worker.name)]
