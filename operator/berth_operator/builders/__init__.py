"""Pure functions from an InferenceService to the child manifests the operator applies, in apply
order; one module per thing built (rank_pods, rank_services, router, network).

No API calls and no clock here: the same input always gives the same dicts, so `berth operator
render` prints exactly what the operator applies, and a second reconcile is a no-op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from berth_operator import constants as c
from berth_operator.builders import network, rank_pods, rank_services, router
from berth_operator.builders.parts import Manifest
from berth_operator.plan import RankPlan, RankSet
from berth_operator.spec import InferenceService


def build_children(
    isvc: InferenceService, plan: RankPlan | None = None, rank_sets: Sequence[RankSet] = ()
) -> list[Manifest]:
    """Every child of one InferenceService, in apply order (workloads before their pointers).

    `plan` overrides the spec's rank count and withdraws ranks from routing (the autoscaler's and
    the health checks' decisions); without it, the spec alone decides. `rank_sets`: where the
    ranks run when the service is placed by AcceleratorPools (one StatefulSet each).
    """
    spec = isvc.spec
    plan = plan or RankPlan.of(isvc)
    if rank_sets:
        statefulsets = [rank_pods.build_rank_statefulset(r.isvc, plan, r) for r in rank_sets]
    else:
        statefulsets = [rank_pods.build_rank_statefulset(isvc, plan)]
    children = [
        rank_services.build_headless_service(isvc),
        *statefulsets,
        *rank_services.build_rank_services(isvc, plan),
        rank_pods.build_rank_pdb(isvc),
    ]
    if spec.has_router:
        children += [
            router.build_router_service_account(isvc),
            router.build_router_role_binding(isvc),
            router.build_router_deployment(isvc),
            router.build_router_pdb(isvc),
        ]
    children.append(network.build_entry_service(isvc))
    if spec.ingress is not None:
        children.append(network.build_ingress(isvc))
    if spec.routing.inference_pool is not None:
        children.append(network.build_inference_pool(isvc))
    if isvc.uid:
        for child in children:
            child["metadata"]["ownerReferences"] = [owner_reference(isvc)]
    return children


def owner_reference(isvc: InferenceService) -> dict[str, Any]:
    # blockOwnerDeletion: foreground deletion of the InferenceService waits for its children.
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "name": isvc.name,
        "uid": isvc.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
