"""Each AcceleratorPool's status: matching Nodes, allocatable and claimed accelerators (in total
and per namespace), the services placed in it, and conditions; `PoolReporter` writes it.

The reporter is one task for all pools. It wakes when a pool, a Node, a namespace or a rank
StatefulSet changes (the handlers call `wake`), recomputes every pool from the operator's watch
caches, and writes a status only when it changed: a quiet cluster costs no requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from berth_operator import k8s, status
from berth_operator.nodes import NodeView, matching
from berth_operator.pool_placement import PoolView
from berth_operator.quota import Ledger
from berth_operator.spec import SpecError
from berth_operator.spec.pool import AcceleratorPool

logger = logging.getLogger(__name__)

NODES_AVAILABLE = "NodesAvailable"
OVER_COMMITTED = "OverCommitted"
PAUSE_AFTER_ERROR_SECONDS = 5.0


def compute(
    pool: AcceleratorPool,
    nodes: Sequence[NodeView],
    claims: Mapping[tuple[str, str], int],
    namespace_labels: Callable[[str], Mapping[str, str]],
    previous: Mapping[str, Any] | None,
    now: str,
) -> dict[str, Any]:
    """The whole status of one pool."""
    previous = previous or {}
    old_conditions = previous.get("conditions") or []
    spec = pool.spec
    resource = spec.accelerator.resource
    matched = matching(spec, nodes)
    allocatable = sum(node.amount(resource) for node in matched)
    claimed = sum(claims.values())
    per_namespace: dict[str, int] = {}
    for (namespace, _), amount in claims.items():
        per_namespace[namespace] = per_namespace.get(namespace, 0) + amount

    def cond(type_: str, value: bool, reason: str, message: str) -> dict[str, Any]:
        return status.condition(
            type_,
            value,
            reason,
            message,
            generation=pool.generation,
            previous=old_conditions,
            now=now,
        )

    if matched:
        nodes_available = cond(
            NODES_AVAILABLE,
            True,
            "NodesMatch",
            f"{len(matched)} nodes match, {allocatable} {resource} allocatable",
        )
    else:
        nodes_available = cond(
            NODES_AVAILABLE,
            False,
            "NoMatchingNodes",
            "no Ready, schedulable node matches the pool's nodeSelector, affinity and "
            "tolerations: ranks placed here stay Pending until one does",
        )
    maximum = spec.limits.max_accelerators
    if maximum is not None and claimed > maximum:
        over = cond(
            OVER_COMMITTED,
            True,
            "OverLimit",
            f"{claimed} {resource} claimed, limits.maxAccelerators is {maximum} (lowered under "
            "running ranks: none is stopped, none is added until claims fall below it)",
        )
    elif claimed > allocatable:
        over = cond(
            OVER_COMMITTED,
            True,
            "OverAllocatable",
            f"{claimed} {resource} claimed, {allocatable} allocatable on matching nodes (nodes "
            "went away, or are still to come)",
        )
    else:
        over = cond(OVER_COMMITTED, False, "WithinCapacity", f"{claimed} of {allocatable} claimed")

    usage = []
    for namespace in sorted(per_namespace):
        entry: dict[str, Any] = {"namespace": namespace, "claimed": per_namespace[namespace]}
        found = spec.limits.namespace_limit(namespace, namespace_labels(namespace))
        if found is not None:
            entry["limit"] = found[1]
        usage.append(entry)
    result: dict[str, Any] = {
        "conditions": [nodes_available, over],
        "nodes": len(matched),
        "allocatable": allocatable,
        "claimed": claimed,
        "maxAccelerators": maximum,
        "namespaces": usage,
        "services": sorted(f"{ns}/{name}" for (ns, name), n in claims.items() if n > 0),
    }
    if pool.generation is not None:
        result["observedGeneration"] = pool.generation
    return result


@dataclass
class PoolReporter:
    """Writes every pool's status when it changes."""

    kube: k8s.Kube
    view: PoolView
    ledger: Ledger
    wake_event: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def wake(self) -> None:
        self.wake_event.set()
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self.run(), name="berth:pools")

    async def stop(self) -> None:
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def run(self) -> None:
        while True:
            await self.wake_event.wait()
            self.wake_event.clear()
            try:
                await self.report_all()
            except asyncio.CancelledError:
                raise
            except Exception:  # the reporter must outlive any one failure
                logger.exception("Reporting the pools' status failed")
                await asyncio.sleep(PAUSE_AFTER_ERROR_SECONDS)
                self.wake_event.set()

    async def report_all(self) -> None:
        nodes = self.view.nodes()
        for name, body in sorted(self.view.pools().items()):
            try:
                pool = AcceleratorPool.from_body(body)
            except SpecError as e:
                logger.warning("AcceleratorPool %s is invalid: %s", name, e)
                continue
            current = body.get("status") or {}
            new = compute(
                pool,
                nodes,
                self.ledger.claims(name),
                self.view.namespace_labels,
                current,
                status.now_rfc3339(),
            )
            patch = status.merge_patch(current, new)
            if not patch:
                continue
            try:
                await self.kube.patch_status(None, name, patch, k8s.ACCELERATORPOOL)
            except k8s.ApiError as e:
                if e.status != 404:  # 404: deleted meanwhile
                    raise
