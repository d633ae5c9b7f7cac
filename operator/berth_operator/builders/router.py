"""The router: its ServiceAccount and RoleBinding (EndpointSlice discovery), its Deployment
running `berth router` in front of the ranks, and its PodDisruptionBudget."""

from __future__ import annotations

from typing import Any

from berth_operator import constants as c
from berth_operator.builders.keys import key_args, key_mounts, key_volumes
from berth_operator.builders.parts import (
    Manifest,
    container_security_context,
    metadata,
    one_at_a_time_pdb,
    pod_security_context,
)
from berth_operator.builders.rank_pods import termination_grace_seconds
from berth_operator.naming import labels, rank_endpoints_selector, router_name, selector_labels
from berth_operator.spec import InferenceService

ROUTER_POLICY_FLAGS = {
    "cacheAware": "cache_aware",
    "leastLoad": "least_load",
    "roundRobin": "round_robin",
}

ROUTER_PRE_STOP_SECONDS = 5


def router_args(isvc: InferenceService) -> list[str]:
    """`berth router` flags: the policy, and where to discover the ranks.

    The router follows the per-rank Services' EndpointSlices itself, so the flags do not depend
    on the number of ranks: scaling never restarts the router (nor empties its prefix tree), and
    a rank that is not ready leaves the router as it leaves its Service.
    """
    spec = isvc.spec
    return [
        "--host",
        "0.0.0.0",
        "--port",
        str(c.HTTP_PORT),
        "--policy",
        ROUTER_POLICY_FLAGS[spec.routing.policy],
        "--discover-selector",
        rank_endpoints_selector(isvc.name),
        "--discover-namespace",
        isvc.namespace,
        "--discover-rank-label",
        c.LABEL_DP_RANK,
        "--discover-port-name",
        "http",
        *key_args(spec),
    ]


def build_router_service_account(isvc: InferenceService) -> Manifest:
    """The router's own identity: it may read EndpointSlices in this namespace, nothing else."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(isvc, router_name(isvc.name), c.ROLE_ROUTER),
        "automountServiceAccountToken": False,  # only the router pod mounts it, explicitly
    }


def build_router_role_binding(isvc: InferenceService) -> Manifest:
    """Grants the router's account the shipped `berth-router` ClusterRole (list and watch
    EndpointSlices) in this namespace only. The operator may bind that role and no other, so it
    needs no EndpointSlice access itself."""
    name = router_name(isvc.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata(isvc, name, c.ROLE_ROUTER),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": c.ROUTER_CLUSTER_ROLE,
        },
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": isvc.namespace}],
    }


def build_router_deployment(isvc: InferenceService) -> Manifest:
    spec = isvc.spec
    runtime = spec.runtime
    env: list[dict[str, Any]] = [{"name": "HOME", "value": c.TMP_MOUNT}]
    pod: dict[str, Any] = {
        # The token lets the router list and watch the rank EndpointSlices (its RoleBinding).
        "serviceAccountName": router_name(isvc.name),
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        # Streams pass through the router: give them as long as the ranks give them.
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "containers": [
            {
                "name": "router",
                "image": isvc.router_image,
                "imagePullPolicy": runtime.image_pull_policy,
                "command": ["berth"],
                "args": ["router", *router_args(isvc)],
                "ports": [{"name": "http", "containerPort": c.HTTP_PORT, "protocol": "TCP"}],
                "env": env,
                "resources": {
                    "requests": {"cpu": "250m", "memory": "256Mi"},
                    "limits": {"memory": "1Gi"},
                },
                "volumeMounts": [{"name": "tmp", "mountPath": c.TMP_MOUNT}, *key_mounts(spec)],
                # Ready once it knows the ranks and has checked them; it does not turn unready
                # when every rank is down (it answers 503 itself, and the InferenceService's
                # status says RanksNotReady rather than RouterNotReady).
                "readinessProbe": {
                    "httpGet": {"path": c.ROUTER_READINESS_PATH, "port": "http"},
                    "periodSeconds": 5,
                    "timeoutSeconds": 5,
                    "failureThreshold": 2,
                },
                "livenessProbe": {
                    "httpGet": {"path": c.ROUTER_LIVENESS_PATH, "port": "http"},
                    "periodSeconds": 15,
                    "timeoutSeconds": 10,
                    "failureThreshold": 4,
                },
                "lifecycle": {
                    "preStop": {"exec": {"command": ["sleep", str(ROUTER_PRE_STOP_SECONDS)]}}
                },
                "securityContext": container_security_context(),
            }
        ],
        "volumes": [{"name": "tmp", "emptyDir": {}}, *key_volumes(spec)],
    }
    if runtime.image_pull_secrets:
        pod["imagePullSecrets"] = [dict(ref) for ref in runtime.image_pull_secrets]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(isvc, router_name(isvc.name), c.ROLE_ROUTER),
        "spec": {
            "replicas": spec.routing.router_replicas,
            "selector": {"matchLabels": selector_labels(isvc.name, c.ROLE_ROUTER)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": {
                "metadata": {"labels": labels(isvc.name, c.ROLE_ROUTER)},
                "spec": pod,
            },
        },
    }


def build_router_pdb(isvc: InferenceService) -> Manifest:
    """A node drain takes one router pod at a time."""
    return one_at_a_time_pdb(isvc, router_name(isvc.name), c.ROLE_ROUTER)
