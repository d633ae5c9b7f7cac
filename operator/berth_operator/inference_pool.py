"""One InferenceService's InferencePool child, which exists only where the cluster serves the
kind: whether it does (API discovery, asked again every minute while the spec wants a pool the
cluster lacks), the pool to apply or prune, and what to tell the user.

InferencePools are not watched (a watch of a kind that is not installed fails until it is): the
worker reads the service's pool by name when it reconciles, so that `children.apply` sees it for
ownership and pruning as it sees the watched kinds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from berth_operator import k8s
from berth_operator.children import ChildKey, Manifest
from berth_operator.spec import InferenceService

logger = logging.getLogger(__name__)

KIND = k8s.INFERENCE_POOL.kind
RECHECK_SECONDS = 60.0
CREATED = "Created"
NOT_INSTALLED = "CRDNotInstalled"
NOT_INSTALLED_MESSAGE = (
    "spec.routing.inferencePool is set, but this cluster does not serve "
    "inference.networking.k8s.io/v1 InferencePools: install the Gateway API Inference "
    "Extension's CRDs. Requests are served through the Berth router as before; the pool is "
    "created within a minute of the CRD being installed"
)


@dataclass(frozen=True)
class Notice:
    """An Event to post: the pool's state changed."""

    type: str
    reason: str
    message: str


@dataclass
class InferencePoolLink:
    """What one worker knows of its service's InferencePool."""

    served: bool | None = None  # whether the API server serves InferencePools (None: not asked)
    next_check: float = 0.0
    may_exist: bool = True  # one of ours may exist (a new worker does not know: it looks)
    state: str | None = None  # CREATED or NOT_INSTALLED while the spec asks for a pool
    _pending: str | None = None  # the state the apply under way leads to

    def recheck_due(self, isvc: InferenceService, now: float) -> bool:
        """Whether to ask again if the CRD is installed: the spec wants a pool that the cluster
        did not serve, and a minute has passed."""
        wanted = isvc.spec.routing.inference_pool is not None
        return wanted and self.served is False and now >= self.next_check

    async def check(self, kube: k8s.Kube, now: float) -> bool:
        """Ask the API server whether it serves InferencePools (a failed answer keeps the last
        one: the next check asks again)."""
        try:
            self.served = await kube.serves(k8s.INFERENCE_POOL)
        except k8s.ApiError as e:
            logger.warning("API discovery of %s failed: %s", KIND, e)
            self.served = bool(self.served)
        self.next_check = now + RECHECK_SECONDS
        return self.served

    async def prepare(
        self,
        kube: k8s.Kube,
        isvc: InferenceService,
        built: list[Manifest],
        known: dict[ChildKey, Mapping[str, Any]],
        now: float,
    ) -> list[Manifest]:
        """The children to apply: without the pool where the cluster lacks the kind; `known`
        is given the existing pool, so that the apply owns or prunes it as any other child."""
        wanted = isvc.spec.routing.inference_pool is not None
        if not wanted and not self.may_exist:
            self._pending = None
            return built
        served = await self.check(kube, now) if self.served is None or wanted else self.served
        if not served:
            self.may_exist = False
            self._pending = NOT_INSTALLED if wanted else None
            return [child for child in built if child["kind"] != KIND]
        existing = await kube.get(k8s.INFERENCE_POOL, isvc.namespace, isvc.name)
        if existing is not None:
            known[(KIND, isvc.name)] = existing
        self.may_exist = True  # until an apply without it has pruned it
        self._pending = CREATED if wanted else None
        return built

    def applied(self, isvc: InferenceService) -> Notice | None:
        """The apply that `prepare` readied went through: the pool's state now, and the Event
        to post if it changed."""
        before, self.state = self.state, self._pending
        self.may_exist = self.state == CREATED
        if self.state == before:
            return None
        if self.state == NOT_INSTALLED:
            return Notice("Warning", "InferencePoolUnavailable", NOT_INSTALLED_MESSAGE)
        if self.state == CREATED:
            return Notice(
                "Normal",
                "InferencePoolCreated",
                f"InferencePool {isvc.name} selects the rank pods on their serving port "
                "(targetPorts) for the inference gateway",
            )
        return None
