"""The InferencePool child on the real API server, with the InferencePool CRD of the Gateway API
Inference Extension's own release (`hack/inference-extension/crds.sh` takes it from the
extension's Go module at the pinned version): first absent, then installed, then no longer asked
for.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from berth_operator import constants as c
from tests.cluster.controlplane import REPO_ROOT, ControlPlane
from tests.cluster.helpers import (
    apply,
    condition,
    events,
    eventually,
    get,
    isvc,
    pods,
    rank_selector,
    wait_condition,
    wait_ready,
)

CRD_SCRIPT = REPO_ROOT / "hack" / "inference-extension" / "crds.sh"
CRD_NAME = "inferencepools.inference.networking.k8s.io"
# The operator asks again every minute whether the CRD is installed; kopf and discovery add a
# little.
RECHECK_TIMEOUT = 90.0


def inference_pool_crd() -> Path:
    """The pinned InferencePool CRD (fetched into the cache on first use: one Go module)."""
    try:
        subprocess.run([str(CRD_SCRIPT)], check=True, capture_output=True, text=True, timeout=300)
    except subprocess.CalledProcessError as e:
        pytest.fail(f"{CRD_SCRIPT} failed:\n{e.stdout}{e.stderr}", pytrace=False)
    found = subprocess.run(
        [str(CRD_SCRIPT), "--print-dir"], check=True, capture_output=True, text=True
    )
    return Path(found.stdout.strip()) / "inferencepools.yaml"


def reasons(plane: ControlPlane, namespace: str, name: str) -> list[str]:
    return [e.get("reason", "") for e in events(plane, namespace, name)]


def test_an_inference_pool_waits_for_its_crd_then_selects_exactly_the_ranks(
    installed: ControlPlane, serving_namespace: str
) -> None:
    plane, ns = installed, serving_namespace
    crd = inference_pool_crd()
    plane.kubectl("delete", "crd", CRD_NAME, "--ignore-not-found", "--wait=true")
    picker = {"name": "gw-epp", "port": 9002, "failureMode": "FailOpen"}
    spec = {"replicas": 2, "routing": {"inferencePool": {"endpointPicker": picker}}}
    apply(plane, ns, isvc("gw", spec))

    # No CRD: the service serves through its router, and says why there is no pool, once.
    wait_ready(plane, ns, "gw")
    body = wait_condition(plane, ns, "gw", "InferencePoolReady", status="False")
    assert condition(body, "InferencePoolReady")["reason"] == "CRDNotInstalled"
    assert "not installed" in condition(body, "InferencePoolReady")["message"]
    eventually(
        lambda: "InferencePoolUnavailable" in reasons(plane, ns, "gw"), what="the Warning Event"
    )

    # The CRD installed: the pool follows within the minute, without touching the spec.
    plane.kubectl("apply", "-f", str(crd))
    plane.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=30s")
    pool = eventually(lambda: get(plane, CRD_NAME, ns, "gw"), RECHECK_TIMEOUT, "the InferencePool")
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector == {c.LABEL_ISVC: "gw", c.LABEL_ROLE: c.ROLE_RANK}
    assert pool["spec"]["targetPorts"] == [{"number": c.HTTP_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "",  # the CRD's default
        "kind": "Service",
        "name": "gw-epp",
        "port": {"number": 9002},
        "failureMode": "FailOpen",
    }
    owner = pool["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == (c.KIND, "gw", True)
    # Exactly the service's rank pods: not its router's, each marked as an SGLang-type server.
    chosen = pods(plane, ns, ",".join(f"{k}={v}" for k, v in selector.items()))
    ranks = pods(plane, ns, rank_selector("gw"))
    assert sorted(p["metadata"]["name"] for p in chosen) == sorted(
        p["metadata"]["name"] for p in ranks
    )
    assert len(chosen) == 2
    assert all(p["metadata"]["labels"][c.LABEL_ENGINE_TYPE] == "sglang" for p in chosen)
    body = wait_condition(plane, ns, "gw", "InferencePoolReady", status="True", reason="Created")
    assert condition(body, "Ready")["status"] == "True"
    eventually(lambda: "InferencePoolCreated" in reasons(plane, ns, "gw"), what="the Event")
    assert reasons(plane, ns, "gw").count("InferencePoolUnavailable") == 1

    # No longer asked for: the pool is deleted, and so is its condition.
    apply(plane, ns, isvc("gw", {"replicas": 2}))
    eventually(lambda: get(plane, CRD_NAME, ns, "gw") is None, what="the pool pruned")
    eventually(
        lambda: not condition(get(plane, "bis", ns, "gw"), "InferencePoolReady"),
        what="the condition removed",
    )
