"""AcceleratorPools in the running operator: the watch caches that placement and the pools'
status read (kopf indices), and who is woken when they change.

Being indices, they make kopf hold every handler back until pools, Nodes, namespaces and the
rank StatefulSets that claim pools are fully listed: after a restart, no service is placed, and
no claim granted, before the ledger has seen every claim already made.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import kopf

from berth_operator import constants as c
from berth_operator.nodes import NodeView
from berth_operator.pool_placement import PoolView
from berth_operator.pool_status import PoolReporter
from berth_operator.quota import Claim, Ledger
from berth_operator.worker import Pools

POOL_CLAIMS = {c.LABEL_POOL: kopf.PRESENT, c.LABEL_MANAGED_BY: c.MANAGED_BY}
INDICES = ("accelerator_pools", "node_views", "namespace_labels", "pool_claims")


@kopf.index(c.GROUP, c.VERSION, c.POOL_PLURAL)
def accelerator_pools(name: str, body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
    return {name: {key: body.get(key) for key in ("metadata", "spec", "status")}}


@kopf.index("", "v1", "nodes")
def node_views(name: str, body: kopf.Body, **_: Any) -> dict[str, NodeView]:
    return {name: NodeView.of(body)}


@kopf.index("", "v1", "namespaces")
def namespace_labels(name: str, labels: kopf.Labels, **_: Any) -> dict[str, dict[str, str]]:
    return {name: dict(labels)}


@kopf.index("apps", "v1", "statefulsets", labels=POOL_CLAIMS)
def pool_claims(
    namespace: str,
    labels: kopf.Labels,
    annotations: kopf.Annotations,
    spec: kopf.Spec,
    **_: Any,
) -> dict[str, Claim]:
    """What a rank StatefulSet claims: replicas x accelerators per rank, in its pool, from its
    first rank on."""
    try:
        per_rank = int(annotations.get(c.ANNOTATION_PER_RANK, "0"))
    except ValueError:
        per_rank = 0
    replicas = spec.get("replicas")
    replicas = 1 if replicas is None else int(replicas)
    start = int((spec.get("ordinals") or {}).get("start") or 0)
    pool = labels[c.LABEL_POOL]
    service = labels.get(c.LABEL_ISVC, "")
    return {pool: Claim(namespace, service, pool, replicas * per_rank, start)}


def set_up(memo: kopf.Memo) -> None:
    """At start-up: the ledger, the view placement reads, and the pools' status reporter."""
    memo.indices = {}
    view = PoolView(
        pools=lambda: {name: _first(store) for name, store in _index(memo, "accelerator_pools")},
        namespace_labels=lambda ns: _first(_index_get(memo, "namespace_labels", ns)) or {},
        nodes=lambda: [v for _, store in _index(memo, "node_views") for v in store],
    )
    ledger = Ledger(observed=lambda: [v for _, store in _index(memo, "pool_claims") for v in store])
    memo.pools = Pools(view, ledger)
    memo.pool_reporter = PoolReporter(memo.kube, view, ledger)


def bind(memo: kopf.Memo, kwargs: Mapping[str, Any]) -> None:
    """Keep the indices kopf hands to handlers (live views) where the rest can read them."""
    for name in INDICES:
        if name in kwargs:
            memo.indices[name] = kwargs[name]


def changed(memo: kopf.Memo) -> None:
    """Pools, Nodes, namespaces or claims changed: report the pools again, and let every service
    that uses pools decide again (a waiting one may now have room, a refused one a pool)."""
    memo.pool_reporter.wake()
    for worker in list(memo.workers.values()):
        if worker.uses_pools or (worker.failure is not None and worker.started):
            worker.wake.set()


def _index(memo: kopf.Memo, name: str) -> Iterable[tuple[Any, Any]]:
    index = memo.indices.get(name)
    return list(index.items()) if index is not None else []


def _index_get(memo: kopf.Memo, name: str, key: str) -> Any:
    index = memo.indices.get(name)
    return index.get(key) if index is not None else None


def _first(store: Any) -> Any:
    return next(iter(store), None) if store is not None else None
