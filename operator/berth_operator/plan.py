"""RankPlan: how many rank pods run and which of them take requests (the observer decides it,
the builders carry it out); RankSet: one StatefulSet's share of them, in one AcceleratorPool."""

from __future__ import annotations

from dataclasses import dataclass

from berth_operator import constants as c
from berth_operator.naming import rank_service_name, service_url
from berth_operator.spec import InferenceService


@dataclass(frozen=True)
class RankPlan:
    """How many rank pods run, and which of them the router must not send requests to.

    A withdrawn rank keeps its pod but loses its per-rank Service, so the router (which follows
    those Services' EndpointSlices) stops routing to it at once: a rank being drained before a
    scale-down, or one whose scheduler has stalled.
    """

    pods: int
    withdrawn: frozenset[int] = frozenset()

    @classmethod
    def of(cls, isvc: InferenceService) -> RankPlan:
        """The plan the spec alone implies: every rank it asks for, all of them routable."""
        return cls(isvc.spec.ranks)

    @property
    def routable(self) -> list[int]:
        return [rank for rank in range(self.pods) if rank not in self.withdrawn]


@dataclass(frozen=True)
class RankSet:
    """Ranks `start` .. `start + count - 1`, one StatefulSet of them in one AcceleratorPool.

    A service placed by pools runs one rank set per pool it uses, in rank order: the first pool
    holds the lowest ranks. `isvc` is the service with that pool's settings merged in."""

    isvc: InferenceService
    pool: str
    per_rank: int
    index: int
    start: int
    count: int


def rank_urls(isvc: InferenceService, plan: RankPlan | None = None) -> list[str]:
    plan = plan or RankPlan.of(isvc)
    return [
        service_url(isvc, rank_service_name(isvc.name, rank), c.HTTP_PORT) for rank in plan.routable
    ]
