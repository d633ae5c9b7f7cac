"""The rank Services: a headless one for stable DNS, and one per routable rank for the router."""

from __future__ import annotations

from berth_operator import constants as c
from berth_operator.builders.parts import Manifest, http_port, metadata
from berth_operator.naming import (
    headless_service_name,
    labels,
    rank_service_name,
    selector_labels,
)
from berth_operator.plan import RankPlan
from berth_operator.spec import InferenceService


def build_headless_service(isvc: InferenceService) -> Manifest:
    """Stable DNS for every rank pod (<name>-<rank>.<name>-ranks), ready or not."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(isvc, headless_service_name(isvc.name), c.ROLE_RANK),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(isvc.name, c.ROLE_RANK),
            "ports": [http_port(c.HTTP_PORT)],
        },
    }


def build_rank_services(isvc: InferenceService, plan: RankPlan | None = None) -> list[Manifest]:
    """One Service per routable rank: its endpoint exists only while that rank is ready."""
    plan = plan or RankPlan.of(isvc)
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": rank_service_name(isvc.name, rank),
                "namespace": isvc.namespace,
                "labels": {**labels(isvc.name, c.ROLE_RANK), c.LABEL_DP_RANK: str(rank)},
                "annotations": {c.LABEL_DP_RANK: str(rank)},
            },
            "spec": {
                "type": "ClusterIP",
                # By ordinal, not pod name: a rank's pod may be in any rank set (one per pool).
                "selector": {
                    **selector_labels(isvc.name, c.ROLE_RANK),
                    c.POD_INDEX_LABEL: str(rank),
                },
                "ports": [http_port(c.HTTP_PORT)],
            },
        }
        for rank in plan.routable
    ]
