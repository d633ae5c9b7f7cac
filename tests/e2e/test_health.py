"""A rank whose scheduler stops (SIGSTOP, the process alive): it is withdrawn from routing (by its
readiness probe or by the operator, whichever sees it first), the router sends to the other rank
only, the operator's Degraded condition names it until its replacement serves, and after
health.restartAfterSeconds the operator deletes the pod, which its StatefulSet brings back."""

from __future__ import annotations

import json

import openai
import pytest

from tests.e2e.cluster import Cluster, Timeline
from tests.e2e.conftest import TIMELINES
from tests.e2e.samples import NAME, PROMPT, cpu_sample, finished_requests, serving

# A real cluster is slow: the first test also waits for the node, its image imports and the install.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

# The scheduler's process title (berth_common.process.set_process_title): found by /proc, as the
# image has no ps.
STOP_SCHEDULER = """
import os, signal
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        continue
    if cmdline.startswith(b"berth::scheduler"):
        os.kill(int(pid), signal.SIGSTOP)
        print(pid)
"""


def test_a_stalled_scheduler_is_withdrawn_reported_and_restarted(installed: Cluster) -> None:
    body = cpu_sample(
        replicas=2,
        # The operator restarts the stalled rank (20 s) before the liveness probe would (60 s).
        health={"stallTimeoutSeconds": 10, "restartAfterSeconds": 20},
    )
    log = Timeline(TIMELINES.setdefault("health: a stalled scheduler (SIGSTOP)", []))
    with serving(installed, body) as namespace:
        log("two ranks Ready")
        stalled_pod = f"{NAME}-1"
        uid = installed.get("pod", stalled_pod, "-n", namespace)["metadata"]["uid"]
        pids = installed.exec(namespace, stalled_pod, "python", "-c", STOP_SCHEDULER).split()
        assert len(pids) == 1, f"expected one scheduler process, stopped {pids}"
        log(f"SIGSTOP to the scheduler of {stalled_pod} (pid {pids[0]})")

        def withdrawn() -> bool:
            # Two mechanisms race: the readiness probe (/health turns 503) marks the endpoint not
            # ready, and the operator's stall detection deletes the rank's Service outright.
            slices = installed.get(
                "endpointslices",
                "-n",
                namespace,
                "-l",
                f"kubernetes.io/service-name={NAME}-rank-1",
            )["items"]
            endpoints = [e for s in slices for e in s.get("endpoints") or []]
            return not any(e["conditions"].get("ready") for e in endpoints)

        installed.wait_until(withdrawn, 60, "rank 1 to be withdrawn from its Service")
        log("rank 1 has no ready endpoint behind its Service")

        def degraded() -> dict:
            status = installed.get("inferenceservice", NAME, "-n", namespace)["status"]
            condition = next(c for c in status["conditions"] if c["type"] == "Degraded")
            assert condition["status"] == "True", (condition, status["ranks"])
            assert "rank 1" in condition["message"], (condition, status["ranks"])
            entry = next(r for r in status["ranks"] if r["rank"] == 1)
            assert entry["state"] in ("Stalled", "Restarting"), entry
            return condition

        condition = installed.wait_until(degraded, 90, "the Degraded condition to name rank 1")
        log(f"Degraded: {condition['reason']}: {condition['message']}")

        with installed.port_forward(namespace, f"svc/{NAME}-rank-0", 8000) as rank0:
            before = finished_requests(rank0)
            with installed.port_forward(namespace, f"svc/{NAME}", 80) as router:
                client = openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0)
                for _ in range(4):
                    reply = client.chat.completions.create(
                        model=NAME, messages=PROMPT, max_tokens=8, temperature=0, timeout=60
                    )
                    assert reply.choices[0].message.content
            assert finished_requests(rank0) - before == 4  # none went to the stalled rank
        log("4 requests through the router: all served by rank 0")

        def restarted() -> bool:
            pod = installed.get("pod", stalled_pod, "-n", namespace)
            assert pod["metadata"]["uid"] != uid
            return any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in pod["status"].get("conditions", [])
            )

        installed.wait_until(restarted, 300, f"{stalled_pod} restarted by the operator, Ready")
        log(f"{stalled_pod} replaced (new pod) and Ready")

        def recovered() -> dict:
            status = installed.get("inferenceservice", NAME, "-n", namespace)["status"]
            condition = next(c for c in status["conditions"] if c["type"] == "Degraded")
            assert condition["status"] == "False", (condition, status["ranks"])
            return condition

        installed.wait_until(recovered, 60, "Degraded to clear once the new pod serves")
        log("Degraded cleared")
        events = installed.kubectl("-n", namespace, "get", "events", "-o", "json").stdout
        by_reason: dict[str, list[str]] = {}
        for event in json.loads(events)["items"]:
            by_reason.setdefault(event["reason"], []).append(event["message"])
        assert any("rank 1" in m for m in by_reason.get("SchedulerStalled", [])), by_reason
        assert any(stalled_pod in m for m in by_reason.get("RankRestarted", [])), by_reason
        assert any("after the restart" in m for m in by_reason.get("RankReplaced", [])), by_reason
        # The kubelet's own report: /health answered 503 to the readiness probe.
        unhealthy = by_reason.get("Unhealthy", [])
        assert any(m.startswith("Readiness probe failed") for m in unhealthy), by_reason
