"""Autoscaling on real load: a burst through the router queues requests on the one rank, the
operator (reading the rank's own metrics) adds a second, which becomes Ready and takes requests,
and once the burst is over it removes it again after scaleDownDelaySeconds. The timeline goes to
the run's summary."""

from __future__ import annotations

import concurrent.futures
import threading

import openai
import pytest

from tests.e2e.cluster import Cluster, Timeline
from tests.e2e.conftest import TIMELINES
from tests.e2e.samples import NAME, cpu_sample, finished_requests, serving

# A real cluster is slow: the first test also waits for the node, its image imports and the install.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
SCALE_DOWN_DELAY_S = 30


def test_a_burst_scales_up_and_the_quiet_after_it_scales_down(installed: Cluster) -> None:
    body = cpu_sample(
        replicas=1,
        autoscaling={
            "enabled": True,
            "minReplicas": 1,
            "maxReplicas": 2,
            "targetQueuePerRank": 1,
            "scaleUpStabilizationSeconds": 0,
            "scaleDownDelaySeconds": SCALE_DOWN_DELAY_S,
        },
    )
    # Two requests at a time per rank: the rest of a burst waits in the scheduler's queue.
    body["spec"]["runtime"]["args"]["maxRunningRequests"] = 2
    log = Timeline(TIMELINES.setdefault("autoscaling: a burst through the router", []))
    with serving(installed, body) as namespace:
        log("one rank Ready")
        stop = threading.Event()
        answered = [0]

        with installed.port_forward(namespace, f"svc/{NAME}", 80) as router:
            client = openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0)

            def load(worker: int) -> None:
                n = 0
                while not stop.is_set():
                    n += 1
                    client.chat.completions.create(
                        model=NAME,
                        messages=[{"role": "user", "content": f"Story {worker}-{n} about a cat."}],
                        max_tokens=48,
                        temperature=0,
                        timeout=300,
                    )
                    answered[0] += 1

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                workers = [pool.submit(load, i) for i in range(8)]
                log("burst started: 8 clients in a loop through the router")
                try:

                    def scaled_up() -> bool:
                        for worker in workers:
                            if worker.done():
                                worker.result()  # a failed request fails the test now
                        isvc = installed.get("inferenceservice", NAME, "-n", namespace)
                        return isvc["status"].get("desiredReplicas") == 2

                    installed.wait_until(scaled_up, 180, "the operator to scale to 2 ranks")
                    scaling = installed.get("inferenceservice", NAME, "-n", namespace)["status"]
                    autoscaler = scaling.get("autoscaler") or {}
                    log(f"scaled up ({autoscaler.get('reason')}): {autoscaler.get('message')}")
                    installed.wait_until(
                        lambda: (
                            installed.get("inferenceservice", NAME, "-n", namespace)["status"][
                                "readyRanks"
                            ]
                            == "2/2"
                        ),
                        420,
                        "the new rank to be Ready",
                    )
                    log("rank 1 Ready")
                    with installed.port_forward(namespace, f"svc/{NAME}-rank-1", 8000) as rank1:
                        installed.wait_until(
                            lambda: finished_requests(rank1) >= 2,
                            180,
                            "the new rank to finish requests from the burst",
                        )
                        log(f"rank 1 finished {finished_requests(rank1):.0f} requests")
                finally:
                    stop.set()
                for worker in workers:
                    worker.result(timeout=300)
        log(f"burst over: {answered[0]} requests answered")

        def decided_down() -> dict:
            status = installed.get("inferenceservice", NAME, "-n", namespace)["status"]
            assert status.get("desiredReplicas") == 1, (status.get("autoscaler"), status["ranks"])
            return status.get("autoscaler") or {}

        autoscaler = installed.wait_until(
            decided_down, SCALE_DOWN_DELAY_S + 180, "the operator to decide on 1 rank"
        )
        log(f"scale down decided ({autoscaler.get('reason')}): {autoscaler.get('message')}")
        installed.wait_until(
            lambda: installed.get("statefulset", NAME, "-n", namespace)["spec"]["replicas"] == 1,
            180,
            "the StatefulSet at 1 replica (after rank 1 drained)",
        )
        log("StatefulSet at 1 replica")
        installed.wait_until(
            lambda: (
                installed.get("inferenceservice", NAME, "-n", namespace)["status"]["readyRanks"]
                == "1/1"
            ),
            180,
            "1/1 ranks ready",
        )
        log("1/1 ranks ready")
