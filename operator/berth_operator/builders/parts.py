"""What every child shares: its metadata, the pods' security contexts, the HTTP port."""

from __future__ import annotations

from typing import Any

from berth_operator import constants as c
from berth_operator.naming import labels
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
