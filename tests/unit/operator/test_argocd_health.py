"""The Argo CD health check: its own health_test.yaml (Argo CD's layout), run with a real Lua
interpreter on objects recorded from the real API server (tests/cluster/test_status.py), and the
argocd-cm snippet that ships it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from tests.unit.operator.argocd import HEALTH_DIR, SCRIPT, argocd_health
from tests.unit.operator.factories import MANIFESTS

CASES = yaml.safe_load((HEALTH_DIR / "health_test.yaml").read_text())["tests"]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case["inputPath"])
def test_health_of_recorded_objects(case: dict[str, Any]) -> None:
    obj = yaml.safe_load((HEALTH_DIR / case["inputPath"]).read_text())
    assert obj["apiVersion"] == "serving.berth.dev/v1alpha1" and obj["kind"] == "InferenceService"
    assert argocd_health(obj) == case["healthStatus"]


def test_every_health_status_is_covered() -> None:
    statuses = {case["healthStatus"]["status"] for case in CASES}
    assert statuses == {"Healthy", "Progressing", "Degraded", "Suspended"}
    inputs = {case["inputPath"] for case in CASES}
    assert inputs == {f"testdata/{p.name}" for p in (HEALTH_DIR / "testdata").glob("*.yaml")}


def test_a_resource_the_operator_has_not_seen_yet_is_progressing() -> None:
    healthy = yaml.safe_load((HEALTH_DIR / "testdata" / "healthy.yaml").read_text())
    fresh = copy.deepcopy(healthy)
    del fresh["status"]
    assert argocd_health(fresh)["status"] == "Progressing"


def test_the_argocd_cm_snippet_carries_the_same_script() -> None:
    cm = yaml.safe_load((MANIFESTS / "argocd" / "argocd-cm.yaml").read_text())
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["name"] == "argocd-cm"
    (key,) = cm["data"]
    # Argo CD's key for a custom health check: resource.customizations.health.<group>_<kind>
    assert key == "resource.customizations.health.serving.berth.dev_InferenceService"
    assert cm["data"][key] == SCRIPT.read_text()
