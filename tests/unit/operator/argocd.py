"""Runs the shipped Argo CD health check as Argo CD does: the object as a Lua table in `obj`,
the script's returned table read as the health (Lua 5.1, as Argo CD's gopher-lua)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lupa import lua51

from tests.unit.operator.factories import MANIFESTS

HEALTH_DIR = MANIFESTS / "argocd" / "serving.berth.dev" / "InferenceService"
SCRIPT = HEALTH_DIR / "health.lua"


def argocd_health(obj: Mapping[str, Any], script: str | None = None) -> dict[str, str]:
    """{"status": ..., "message": ...} as Argo CD would compute it for `obj`."""
    lua = lua51.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(script if script is not None else SCRIPT.read_text())
    return {"status": result["status"], "message": result["message"]}
