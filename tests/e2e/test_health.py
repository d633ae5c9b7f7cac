"""A rank whose scheduler stops (SIGSTOP, the process alive): its readiness probe withdraws it,
the router sends to the other rank only, the operator's Degraded condition names it, and after
health.restartAfterSeconds the operator deletes the pod, which its StatefulSet brings back."""

from __future__ import annotations

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


@pytest.mark.skip(
    reason="flaky on real pods (1 run in 4): once, the readiness probe withdrew the stopped rank "
    "(its /health answered 503) but the operator's Degraded condition still said 'no stalled "
    "rank' 90 s later; the cause is not found yet (issue 36)"
)
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
            slices = installed.get(
                "endpointslices",
                "-n",
                namespace,
                "-l",
                f"kubernetes.io/service-name={NAME}-rank-1",
            )["items"]
            endpoints = [e for s in slices for e in s.get("endpoints") or []]
            return bool(endpoints) and not any(e["conditions"].get("ready") for e in endpoints)

        installed.wait_until(withdrawn, 60, "the readiness probe to withdraw rank 1")
        log("rank 1 withdrawn from its Service (readiness probe)")

        def degraded() -> dict:
            conditions = installed.get("inferenceservice", NAME, "-n", namespace)["status"][
                "conditions"
            ]
            condition = next(c for c in conditions if c["type"] == "Degraded")
            ranks = installed.get("inferenceservice", NAME, "-n", namespace)["status"]["ranks"]
            assert condition["status"] == "True", (condition, ranks)
            assert "rank 1" in condition["message"], (condition, ranks)
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
        events = installed.kubectl(
            "-n", namespace, "get", "events", "--field-selector", "reason=RankRestarted"
        ).stdout
        assert "rank 1" in events or stalled_pod in events, events
