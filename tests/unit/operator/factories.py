"""Plain factories and file loaders shared by the operator tests."""

from __future__ import annotations

import copy
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml

from berth_operator import constants as c
from berth_operator.spec import InferenceService

REPO_ROOT = Path(__file__).resolve().parents[3]
CRD_PATH = REPO_ROOT / "crds" / "serving.berth.dev_inferenceservices.yaml"
MANIFESTS = REPO_ROOT / "manifests"
SAMPLES = sorted((MANIFESTS / "samples").glob("serving_*.yaml"))
# The oldest Kubernetes the children must be valid for (pod-index label: 1.28+) and the newest.
K8S_VERSIONS = ("1.29", "1.37")


def isvc_body(
    spec: dict[str, Any] | None = None,
    *,
    name: str = "chat",
    namespace: str = "team-a",
    uid: str | None = "0b6f3f4e-0000-4000-8000-000000000001",
    generation: int | None = 1,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if uid is not None:
        meta["uid"] = uid
    if generation is not None:
        meta["generation"] = generation
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "metadata": meta,
        "spec": copy.deepcopy(spec) if spec is not None else {},
    }


def parse(spec: dict[str, Any] | None = None, **kwargs: Any) -> InferenceService:
    return InferenceService.from_body(isvc_body(spec, **kwargs))


# Every feature switched on at once: the children of this spec cover every kind and field.
FULL_SPEC: dict[str, Any] = {
    "model": {
        "uri": "hf://meta-llama/Llama-3.1-8B-Instruct",
        "servedName": "llama",
        "revision": "v1.0",
        "sizeGiB": 16,
        "hfTokenSecretRef": {"name": "hf-token"},
        "cache": {"claimName": "model-cache"},
    },
    "runtime": {
        "image": "registry.example.com/berth-runtime:dev",
        "imagePullPolicy": "Always",
        "imagePullSecrets": [{"name": "regcred"}],
        "args": {
            "dtype": "bfloat16",
            "device": "cuda",
            "contextLength": 8192,
            "maxRunningRequests": 128,
            "maxTotalTokens": 200000,
            "maxPrefillTokens": 8192,
            "chunkedPrefillSize": 1024,
            "maxQueuedRequests": 512,
            "schedulePolicy": "lpm",
            "disableRadixCache": True,
            "logLevel": "debug",
            "grammarBackend": "xgrammar",
            "toolCallParser": "hermes",
            "reasoningParser": "qwen3",
        },
        "gracefulShutdownSeconds": 120,
        "preStopSleepSeconds": 15,
        "startupTimeoutSeconds": 1800,
        "extraArgs": ["--random-seed", "7"],
        "env": [
            {"name": "NCCL_DEBUG", "value": "INFO"},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ],
    },
    "resources": {
        "gpus": 2,
        "gpuResource": "amd.com/gpu",
        "cpu": 8,
        "memory": "64Gi",
        "cpuLimit": "16",
        "memoryLimit": "80Gi",
        "sharedMemory": "16Gi",
    },
    "parallelism": {"tensor": 1},
    "replicas": 3,
    "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
    "health": {"stallTimeoutSeconds": 20, "restartAfterSeconds": 0, "imbalanceWindowSeconds": 30},
    "routing": {"policy": "leastLoad", "routerReplicas": 2},
    "ingress": {
        "host": "chat.example.com",
        "className": "nginx",
        "annotations": {"nginx.ingress.kubernetes.io/proxy-read-timeout": "600"},
        "tls": {"secretName": "chat-tls"},
    },
    "apiKeySecretRef": {"name": "chat-key", "key": "token"},
    "adminApiKeySecretRef": {"name": "chat-admin-key"},
    "scheduling": {
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}
                    ]
                }
            }
        },
        "priorityClassName": "inference-high",
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"serving.berth.dev/inferenceservice": "chat"}},
            }
        ],
        "runtimeClassName": "nvidia",
    },
}

# One spec per model source and router/ingress combination, for the schema checks.
SPEC_MATRIX: dict[str, dict[str, Any]] = {
    "empty": {},
    "builtin-no-router": {"routing": {"routerReplicas": 0}, "replicas": 2},
    "hf-gguf-file": {
        "model": {"uri": "hf://bartowski/Llama-3.2-1B-Instruct-GGUF/Llama-3.2-1B-Q4_K_M.gguf"}
    },
    "hf-emptydir-limit": {
        "model": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct", "cache": {"sizeLimit": "10Gi"}}
    },
    "pvc": {"model": {"uri": "pvc://models/llama/8b", "sizeGiB": 16}, "resources": {"gpus": 1}},
    "file": {"model": {"uri": "file:///models/smollm2"}, "replicas": 0},
    "ingress-no-host": {"ingress": {}},
    "full": FULL_SPEC,
}


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d]


def crd() -> dict[str, Any]:
    (doc,) = load_yaml_docs(CRD_PATH)
    return doc


def crd_schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_schema_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting as the API server does it: top down, defaulted objects included."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        if isinstance(value, list) and "items" in schema:
            return [apply_schema_defaults(schema["items"], v) for v in value]
        return value
    result = dict(value)
    for key, sub in (schema.get("properties") or {}).items():
        if key not in result and "default" in sub:
            result[key] = copy.deepcopy(sub["default"])
        if key in result:
            result[key] = apply_schema_defaults(sub, result[key])
    return result


def kustomize(path: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (needed for `kubectl kustomize`)")
    out = subprocess.run(
        [kubectl, "kustomize", str(path)], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def validate_strict(obj: dict[str, Any], version: str) -> None:
    """kubernetes-validate in strict mode, failing with a short message instead of a schema dump."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = "/".join(str(p) for p in e.path)
        kind, name = obj.get("kind"), obj.get("metadata", {}).get("name")
        pytest.fail(f"{kind} {name} invalid for Kubernetes {version} at {where}: {e.message}")


SCHEMA = crd_schema()
CEL = celpy.Environment()


def walk(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{key}")
    if "items" in schema:
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with unknown fields refused where the API server would prune them."""
    schema = copy.deepcopy(schema)
    for _, node in walk(schema):
        if (
            node.get("type") == "object"
            and "properties" in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
            and "additionalProperties" not in node
        ):
            node["additionalProperties"] = False
    return schema


def validate_against_crd(body: dict[str, Any]) -> dict[str, Any]:
    defaulted = apply_schema_defaults(SCHEMA, body)
    jsonschema.Draft4Validator(closed(SCHEMA)).validate(defaulted)
    check_list_map_keys(SCHEMA, defaulted)
    return defaulted


def check_list_map_keys(schema: dict[str, Any], value: Any, path: str = "") -> None:
    """`x-kubernetes-list-type: map` as the API server enforces it: one item per key."""
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                check_list_map_keys(sub, value[key], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        if schema.get("x-kubernetes-list-type") == "map":
            keys = schema["x-kubernetes-list-map-keys"]
            seen = set()
            for i, item in enumerate(value):
                key = tuple(item.get(k) for k in keys)
                if key in seen:
                    raise jsonschema.ValidationError(f"{path}[{i}]: Duplicate value: {key}")
                seen.add(key)
        for i, item in enumerate(value):
            check_list_map_keys(schema["items"], item, f"{path}[{i}]")


CEL = celpy.Environment()


def cel_failures(body: dict[str, Any], schema: dict[str, Any] | None = None) -> list[str]:
    """Evaluate every x-kubernetes-validations rule on the (defaulted) object, like admission
    (of the InferenceService CRD unless another `schema` is given)."""
    schema = SCHEMA if schema is None else schema
    failures: list[str] = []

    def visit(schema: dict[str, Any], value: Any) -> None:
        for rule in schema.get("x-kubernetes-validations") or []:
            program = CEL.program(CEL.compile(rule["rule"]))
            result = program.evaluate({"self": celpy.json_to_cel(value)})
            if isinstance(result, Exception) or not bool(result):
                failures.append(rule["message"])
        if isinstance(value, dict):
            for key, sub in (schema.get("properties") or {}).items():
                if key in value:
                    visit(sub, value[key])
        if isinstance(value, list) and "items" in schema:
            for item in value:
                visit(schema["items"], item)

    visit(schema, apply_schema_defaults(schema, body))
    return failures


def validation_errors(schema: dict[str, Any], body: dict[str, Any]) -> list[str]:
    """What the API server would refuse of `body` under `schema`: the structural schema with
    unknown fields refused (kubectl's strict field validation), and the CEL rules."""
    defaulted = apply_schema_defaults(schema, body)
    errors = [e.message for e in jsonschema.Draft4Validator(closed(schema)).iter_errors(defaulted)]
    return errors + cel_failures(body, schema)


def role_rules() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) that the operator's shipped ClusterRole grants."""
    role = yaml.safe_load((MANIFESTS / "rbac" / "role.yaml").read_text())
    assert role["kind"] == "ClusterRole" and role["metadata"]["name"] == "berth-operator"
    granted = set()
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb), "no wildcards"
                    granted.add((group, resource, verb))
    return granted
