"""The way in: the entry Service (router, or the ranks themselves), the Ingress, and the
InferencePool that a Gateway API inference gateway routes through."""

from __future__ import annotations

from typing import Any

from berth_operator import constants as c
from berth_operator.builders.parts import Manifest, http_port, metadata
from berth_operator.naming import entry_service_name, selector_labels
from berth_operator.spec import InferenceService


def build_entry_service(isvc: InferenceService) -> Manifest:
    """The single entry point: the router, or the ranks themselves when there is no router."""
    role = c.ROLE_ROUTER if isvc.spec.has_router else c.ROLE_RANK
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(isvc, entry_service_name(isvc.name), None),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(isvc.name, role),
            "ports": [http_port(c.SERVICE_PORT)],
        },
    }


def build_ingress(isvc: InferenceService) -> Manifest:
    ingress = isvc.spec.ingress
    assert ingress is not None  # callers check spec.ingress
    rule: dict[str, Any] = {
        "http": {
            "paths": [
                {
                    "path": ingress.path,
                    "pathType": ingress.path_type,
                    "backend": {
                        "service": {
                            "name": entry_service_name(isvc.name),
                            "port": {"name": "http"},
                        }
                    },
                }
            ]
        }
    }
    if ingress.host:
        rule = {"host": ingress.host, **rule}
    meta = metadata(isvc, isvc.name, None)
    if ingress.annotations:
        meta["annotations"] = dict(ingress.annotations)
    spec: dict[str, Any] = {"rules": [rule]}
    if ingress.class_name:
        spec["ingressClassName"] = ingress.class_name
    if ingress.tls is not None:
        spec["tls"] = [{"hosts": [ingress.host], "secretName": ingress.tls.secret_name}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": meta,
        "spec": spec,
    }


INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"


def build_inference_pool(isvc: InferenceService) -> Manifest:
    """An InferencePool of exactly this service's rank pods, on their serving port: the gateway
    sends each request to the rank its endpoint picker chooses (from the ranks' own /metrics,
    read as SGLang's: the pods carry llm-d.ai/engine-type: sglang)."""
    pool = isvc.spec.routing.inference_pool
    assert pool is not None  # callers check spec.routing.inference_pool
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(isvc.name, c.ROLE_RANK)},
        "targetPorts": [{"number": c.HTTP_PORT}],
    }
    picker = pool.endpoint_picker
    if picker is not None:
        spec["endpointPickerRef"] = {
            "kind": "Service",
            "name": picker.name,
            "port": {"number": picker.port},
            "failureMode": picker.failure_mode,
        }
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": metadata(isvc, isvc.name, None),
        "spec": spec,
    }
