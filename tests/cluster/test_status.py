"""Status through a service's life, as GitOps tools read it: kstatus' documented rules and the
shipped Argo CD health check, applied to every version of a live InferenceService.

A `kubectl get -w` follows one InferenceService from creation through a rollout, a spec change,
a spec only the operator can refuse, and a scale to zero. Every version the API server sent is
checked: observedGeneration everywhere, Ready from the first status on, and what kstatus (Flux,
`kpt live status`) and Argo CD make of it.

The health check's own tests (manifests/argocd/.../health_test.yaml, run by
tests/unit/operator/test_argocd_health.py on the objects in testdata/) must expect what the
check says of each live phase here: when the operator's status or the script changes, this test
fails until they are recorded again. `BERTH_RECORD_ARGOCD_FIXTURES=1` records them: it writes
each phase's object into testdata/ and its health into health_test.yaml, so that those tests run
on objects the real API server produced.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.controlplane import REPO_ROOT, ControlPlane
from tests.cluster.helpers import (
    apply,
    condition,
    isvc,
    kstatus,
    wait_condition,
    wait_ready,
)
from tests.unit.operator.argocd import HEALTH_DIR, argocd_health

RECORD = os.environ.get("BERTH_RECORD_ARGOCD_FIXTURES") == "1"
HEALTH_TESTS = HEALTH_DIR / "health_test.yaml"
# Phases caught mid-way: which Ready reason and how many ranks and routers are ready depend on
# when the version was written ("RanksNotReady: 1/2 ranks ready; router 0/1 ready" one run,
# "RouterNotReady: 2/2 ranks ready; router 0/1 ready" the next). Their messages are compared
# with the reason and the counts left out; every other message word for word.
MID_WAY = {"creating", "rolling"}


class Versions:
    """Every version of the InferenceServices in a namespace, from `kubectl get -w -o json`."""

    def __init__(self, plane: ControlPlane, namespace: str) -> None:
        self.items: list[dict[str, Any]] = []
        self.process = subprocess.Popen(
            [str(plane.kubectl_binary), "get", "bis", "-n", namespace, "-w", "-o", "json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=plane.env(),
        )
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        decoder = json.JSONDecoder()
        buffer = ""
        for line in self.process.stdout:
            buffer += line.decode()
            while buffer.strip():
                try:
                    obj, end = decoder.raw_decode(buffer.lstrip())
                except ValueError:
                    break
                self.items.append(obj)
                buffer = buffer.lstrip()[end:]

    def stop(self) -> list[dict[str, Any]]:
        self.process.terminate()
        self.process.wait(10)
        self.thread.join(10)
        return self.items


@pytest.fixture
def versions(installed: ControlPlane, serving_namespace: str) -> Iterator[Versions]:
    watcher = Versions(installed, serving_namespace)
    try:
        yield watcher
    finally:
        watcher.stop()


def first(items: list[dict[str, Any]], test: Callable[[dict[str, Any]], bool]) -> dict:
    found = [item for item in items if test(item)]
    assert found, "no version matched among: " + "; ".join(map(summary, items))
    return found[0]


def summary(obj: dict[str, Any]) -> str:
    conditions = ",".join(
        f"{c['type']}={c['status']}/{c['reason']}"
        for c in obj.get("status", {}).get("conditions", [])
    )
    observed = obj.get("status", {}).get("observedGeneration")
    return f"gen {obj['metadata']['generation']} observed {observed} {conditions}"


def scrubbed(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as recorded, in namespace team-a instead of the test's random one."""
    namespace = obj["metadata"]["namespace"]
    obj = json.loads(json.dumps(obj).replace(namespace, "team-a"))
    obj["metadata"].pop("managedFields", None)
    return obj


def comparable(phase: str, health: Mapping[str, str]) -> dict[str, str]:
    """The health as compared with health_test.yaml's (see MID_WAY)."""
    message = health["message"]
    if phase in MID_WAY:
        message = re.sub(r"\d+/\d+", "N/N", re.sub(r"^[A-Za-z]+: ", "REASON: ", message))
    return {"status": health["status"], "message": message}


def recorded_health() -> dict[str, dict[str, str]]:
    """What health_test.yaml expects, by phase (its input testdata/<phase>.yaml)."""
    tests = yaml.safe_load(HEALTH_TESTS.read_text())["tests"]
    return {Path(test["inputPath"]).stem: test["healthStatus"] for test in tests}


def record(objects: Mapping[str, dict[str, Any]], health: Mapping[str, dict[str, str]]) -> None:
    """Write each phase's object into testdata/ and its health into health_test.yaml (its
    leading comment and the order of its entries kept; a new phase is added at the end)."""
    testdata = HEALTH_DIR / "testdata"
    for phase, obj in objects.items():
        (testdata / f"{phase}.yaml").write_text(yaml.safe_dump(obj, sort_keys=False))
    text = HEALTH_TESTS.read_text()
    header = "".join(line for line in text.splitlines(True) if line.startswith("#"))
    tests = yaml.safe_load(text)["tests"]
    known = {Path(test["inputPath"]).stem for test in tests}
    tests += [{"inputPath": f"testdata/{phase}.yaml"} for phase in objects if phase not in known]
    tests = [
        {"healthStatus": health[Path(test["inputPath"]).stem], "inputPath": test["inputPath"]}
        for test in tests
        if Path(test["inputPath"]).stem in objects
    ]
    HEALTH_TESTS.write_text(header + yaml.safe_dump({"tests": tests}, sort_keys=False))
    print(
        f"recorded {len(objects)} objects and their health into {HEALTH_DIR.relative_to(REPO_ROOT)}"
    )


def test_status_follows_kstatus_and_argo_cd_reads_it(
    installed: ControlPlane, serving_namespace: str, versions: Versions
) -> None:
    plane, ns, name = installed, serving_namespace, "chat"
    spec: dict[str, Any] = {"replicas": 2}
    apply(plane, ns, isvc(name, spec))
    wait_ready(plane, ns, name)
    # A rollout that cannot finish: no node has 100 CPUs for the updated rank.
    spec["resources"] = {"cpu": "100"}
    apply(plane, ns, isvc(name, spec))
    wait_condition(plane, ns, name, "Degraded", reason="PodsFailing")
    # Valid for the CRD, refused by the operator: --mod is a prefix of --model, which argparse
    # would accept as --model.
    spec["runtime"] = {"extraArgs": ["--mod", "x"]}
    apply(plane, ns, isvc(name, spec))
    wait_condition(plane, ns, name, "Stalled", status="True")
    del spec["runtime"]
    spec["replicas"] = 0
    apply(plane, ns, isvc(name, spec))
    wait_condition(plane, ns, name, "Ready", status="True", reason="ScaledToZero")
    items = [item for item in versions.stop() if item["metadata"]["name"] == name]

    # observedGeneration on the status and on every condition; Ready from the first status on.
    with_status = [item for item in items if item.get("status")]
    assert with_status
    assert {c["type"] for c in with_status[0]["status"]["conditions"]} >= {
        "Ready",
        "Reconciling",
        "Stalled",
    }
    for item in with_status:
        status = item["status"]
        assert isinstance(status["observedGeneration"], int)
        for cond in status["conditions"]:
            assert cond["observedGeneration"] == status["observedGeneration"], cond

    # kstatus' rules, and Argo CD's health check, on each phase.
    creating = first(
        items,
        lambda o: (
            o["metadata"]["generation"] == 1 and condition(o, "Reconciling").get("status") == "True"
        ),
    )
    healthy = first(items, lambda o: condition(o, "Ready").get("status") == "True")
    unobserved = first(
        items,
        lambda o: o["metadata"]["generation"] == 2 and o["status"].get("observedGeneration") == 1,
    )
    rolling = first(
        items,
        lambda o: (
            o["metadata"]["generation"] == 2
            and o["status"].get("observedGeneration") == 2
            and condition(o, "Degraded").get("reason") == "PodsFailing"
        ),
    )
    invalid = first(items, lambda o: condition(o, "Stalled").get("status") == "True")
    suspended = first(items, lambda o: condition(o, "Ready").get("reason") == "ScaledToZero")
    phases = {
        "creating": (creating, "InProgress", "Progressing"),
        "healthy": (healthy, "Current", "Healthy"),
        "unobserved": (unobserved, "InProgress", "Progressing"),
        "rolling": (rolling, "InProgress", "Progressing"),
        "invalid": (invalid, "Failed", "Degraded"),
        "suspended": (suspended, "Current", "Suspended"),
    }
    for phase, (obj, expected_kstatus, expected_health) in phases.items():
        assert kstatus(obj)[0] == expected_kstatus, (phase, kstatus(obj), obj["status"])
        assert argocd_health(obj)["status"] == expected_health, (phase, argocd_health(obj))
    assert (
        "--mod (read as --model) is set by the operator" in condition(invalid, "Stalled")["message"]
    )
    assert condition(invalid, "Ready")["reason"] == "InvalidSpec"
    assert condition(rolling, "Reconciling")["reason"] == "RollingUpdate"
    assert "Unschedulable" in condition(rolling, "Degraded")["message"]
    assert "Insufficient cpu" in condition(rolling, "Degraded")["message"]

    # The health check's own tests expect what it says of these very phases (as recorded: in
    # namespace team-a).
    objects = {phase: scrubbed(obj) for phase, (obj, _, _) in phases.items()}
    health = {phase: argocd_health(obj) for phase, obj in objects.items()}
    if RECORD:
        record(objects, health)
    recorded = recorded_health()
    assert {p: comparable(p, h) for p, h in health.items()} == {
        p: comparable(p, h) for p, h in recorded.items()
    }, (
        "manifests/argocd/.../health_test.yaml is stale: record it again with "
        "BERTH_RECORD_ARGOCD_FIXTURES=1"
    )
