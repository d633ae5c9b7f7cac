"""The API keys of an InferenceService, for its ranks and its router: Secrets mounted as files.

A key reaches `berth serve` and `berth router` as `--api-key-file` / `--admin-api-key-file`
pointing into one read-only projected volume, never as an argument (visible in the pod spec and
in `ps`) nor as an environment variable (inherited by every child process).
"""

from __future__ import annotations

from typing import Any

from berth_operator import constants as c
from berth_operator.spec import AdminApiKeySecretRef, ApiKeySecretRef, InferenceServiceSpec

KeyRef = ApiKeySecretRef | AdminApiKeySecretRef

VOLUME = "api-keys"
API_KEY_FILE = "api-key"
ADMIN_API_KEY_FILE = "admin-api-key"


def _refs(spec: InferenceServiceSpec) -> list[tuple[str, str, KeyRef]]:
    """(flag, file name, Secret reference) of each key the spec asks for."""
    refs: list[tuple[str, str, KeyRef]] = []
    if spec.api_key is not None:
        refs.append(("--api-key-file", API_KEY_FILE, spec.api_key))
    if spec.admin_api_key is not None:
        refs.append(("--admin-api-key-file", ADMIN_API_KEY_FILE, spec.admin_api_key))
    return refs


def key_args(spec: InferenceServiceSpec) -> list[str]:
    args: list[str] = []
    for flag, file, _ in _refs(spec):
        args += [flag, f"{c.KEYS_MOUNT}/{file}"]
    return args


def key_volumes(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    refs = _refs(spec)
    if not refs:
        return []
    sources = [
        {"secret": {"name": ref.name, "items": [{"key": ref.key, "path": file}]}}
        for _, file, ref in refs
    ]
    # Readable by the pod's group only (fsGroup is the runtime's user).
    return [{"name": VOLUME, "projected": {"sources": sources, "defaultMode": 0o440}}]


def key_mounts(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    if not _refs(spec):
        return []
    return [{"name": VOLUME, "mountPath": c.KEYS_MOUNT, "readOnly": True}]
