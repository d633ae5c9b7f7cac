"""What every child shares: its metadata, the pods' security contexts, the HTTP port, the
one-pod-at-a-time PodDisruptionBudget."""

from __future__ import annotations

from typing import Any

from berth_operator import constants as c
from berth_operator.naming import labels, selector_labels
from berth_operator.spec import InferenceService

Manifest = dict[str, Any]


def metadata(isvc: InferenceService, name: str, role: str | None) -> dict[str, Any]:
    return {"name": name, "namespace": isvc.namespace, "labels": labels(isvc.name, role)}


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": c.RUN_AS_UID,
        "runAsGroup": c.RUN_AS_UID,
        "fsGroup": c.RUN_AS_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def http_port(port: int) -> dict[str, Any]:
    return {"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}


def one_at_a_time_pdb(isvc: InferenceService, name: str, role: str) -> Manifest:
    """A PodDisruptionBudget: voluntary disruptions (node drains) take one pod of `role` at a
    time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(isvc, name, role),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(isvc.name, role)},
        },
    }
