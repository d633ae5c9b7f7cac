"""The quota ledger: what Berth ranks claim in each AcceleratorPool, and how many ranks a service
may have there under every limit. A service may hold ranks in several pools (one rank set, one
StatefulSet, in each); the ledger counts each pool on its own.

Claims come from two places and the larger counts: the rank StatefulSets as the API server has
them (`observed`, a live view of the operator's watch, which an operator restart rebuilds before
any service is placed), and the decisions this operator has made but not yet seen applied
(`reserved`). Every decision is made synchronously on the operator's one event loop, so two
services scaling up at once are decided one after the other, and the second sees the first's
reservation: together they never exceed a limit.

Quota never takes a running rank away: a service keeps the ranks it has when a limit is lowered
under it, and only gets new ones while there is room. A service that wants more than it may have
waits, and room that frees up goes to waiting services oldest first: a younger service may only
use room that the older ones waiting on the same limit cannot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from berth_operator.spec.pool import AcceleratorPool

ServiceKey = tuple[str, str]  # (namespace, name)
POOL_SCOPE = "pool"


@dataclass(frozen=True)
class Claim:
    """Accelerators one service's ranks hold in one pool."""

    namespace: str
    service: str
    pool: str
    accelerators: int
    start: int = 0  # the first rank of the service's rank set in this pool

    @property
    def key(self) -> ServiceKey:
        return self.namespace, self.service


@dataclass(frozen=True)
class Waiting:
    """A service that wants more than it was granted, and the limit that stopped it."""

    pool: str
    created: str  # the InferenceService's creationTimestamp (RFC 3339 sorts as text)
    unmet: int  # accelerators
    scope: str  # POOL_SCOPE, or "namespace:<name>"


@dataclass(frozen=True)
class Grant:
    """How many ranks a service may run, in which pools (in rank order); `limit` names what held
    it back, if anything."""

    pools: tuple[tuple[str, int], ...]  # (pool, ranks)
    ranks: int
    wanted: int
    limit: str | None = None

    @property
    def short(self) -> bool:
        return self.ranks < self.wanted


@dataclass(frozen=True)
class Room:
    ranks: int
    limit: str | None  # the tightest limit, for a person; None: nothing limits
    scope: str | None


@dataclass
class Ledger:
    observed: Callable[[], Iterable[Claim]] = lambda: ()
    reserved: dict[ServiceKey, tuple[Claim, ...]] = field(default_factory=dict)
    waiting: dict[ServiceKey, tuple[Waiting, ...]] = field(default_factory=dict)

    def _all(self) -> list[Claim]:
        return [*self.observed(), *(c for claims in self.reserved.values() for c in claims)]

    def claims(self, pool: str) -> dict[ServiceKey, int]:
        """Accelerators each service holds in `pool`: the larger of seen and decided."""
        result: dict[ServiceKey, int] = {}
        for claim in self._all():
            if claim.pool == pool:
                result[claim.key] = max(result.get(claim.key, 0), claim.accelerators)
        return result

    def holdings(self, key: ServiceKey) -> dict[str, Claim]:
        """The service's claim in each pool where it holds accelerators now: the larger of seen
        and decided, at the first rank decided last."""
        result = {claim.pool: claim for claim in self.reserved.get(key, ())}
        for claim in self.observed():
            mine = result.get(claim.pool)
            if claim.key != key:
                continue
            if mine is None:
                result[claim.pool] = claim
            elif claim.accelerators > mine.accelerators:
                result[claim.pool] = dataclasses.replace(claim, start=mine.start)
        return {pool: claim for pool, claim in result.items() if claim.accelerators > 0}

    def room(
        self,
        pool: AcceleratorPool,
        key: ServiceKey,
        namespace_labels: Mapping[str, str],
        created: str,
        per_rank: int,
    ) -> Room:
        """How many ranks the service could have in `pool` in all (its own claim not counted
        against it), under every limit, after the older services waiting on each limit."""
        namespace = key[0]
        claims = self.claims(pool.name)
        claims.pop(key, None)
        limits = pool.spec.limits
        # The namespace's limit first: on a tie it is the one the service waits on, so that its
        # unmet demand never holds back other namespaces' services on the pool-wide limit.
        scopes: list[tuple[str, str, int]] = []
        found = limits.namespace_limit(namespace, namespace_labels)
        if found is not None:
            index, maximum = found
            used = sum(n for (ns, _), n in claims.items() if ns == namespace)
            text = (
                f"pool {pool.name}: limits.namespaces[{index}].maxAccelerators is {maximum} "
                f"for namespace {namespace}"
            )
            scopes.append((f"namespace:{namespace}", text, maximum - used))
        if limits.max_accelerators is not None:
            used = sum(claims.values())
            text = f"pool {pool.name}: limits.maxAccelerators is {limits.max_accelerators}"
            scopes.append((POOL_SCOPE, text, limits.max_accelerators - used))
        rooms = [
            (
                max(0, free - self._older_waiting(pool.name, key, created, scope)) // per_rank,
                scope,
                text,
            )
            for scope, text, free in scopes
        ]
        if not rooms:
            return Room(ranks=1 << 30, limit=None, scope=None)
        least = min(ranks for ranks, _, _ in rooms)
        binding = [(scope, text) for ranks, scope, text in rooms if ranks == least]
        return Room(least, "; ".join(text for _, text in binding), binding[0][0])

    def reserve(
        self, key: ServiceKey, claims: tuple[Claim, ...], waiting: tuple[Waiting, ...]
    ) -> None:
        """Record the service's decided claims (every pool it runs in) and what it waits for."""
        self.reserved[key] = claims
        if waiting:
            self.waiting[key] = waiting
        else:
            self.waiting.pop(key, None)

    def stop_waiting(self, key: ServiceKey) -> None:
        """The service wants nothing more for now (refused, or its spec invalid)."""
        self.waiting.pop(key, None)

    def release(self, key: ServiceKey) -> None:
        """The service is gone (its StatefulSet's claim goes with the StatefulSet)."""
        self.reserved.pop(key, None)
        self.waiting.pop(key, None)

    def _older_waiting(self, pool: str, key: ServiceKey, created: str, scope: str) -> int:
        return sum(
            waiting.unmet
            for other, entries in self.waiting.items()
            if other != key
            for waiting in entries
            if waiting.pool == pool
            and waiting.scope == scope
            and (waiting.created, other) < (created, key)
        )
