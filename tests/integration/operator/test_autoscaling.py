"""Autoscaling and health from the schedulers' own metrics, on real signals.

kopf runs the operator against kmock's emulated API; the rank pods are played by the test (there
is no StatefulSet controller), and each points (pod IP 127.0.0.1, container port `http`) at a
real `berth serve` process on loopback, whose `/metrics` the operator scrapes. Load is real
requests; a stalled scheduler is a real SIGSTOP.
"""

from __future__ import annotations

import asyncio
import copy
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from berth_operator import constants as c
from berth_operator import metrics as operator_metrics
from berth_operator import naming
from tests.helpers import RunningServer, embedded_model_dir, running_servers, scheduler_process
from tests.unit.operator.factories import role_rules

from .conftest import (
    ISVC,
    NS,
    STS,
    Cluster,
    eventually,
    isvc,
    mark_ready,
    posted_events,
    reason,
    running_operator,
)

SVC = "v1/services"
DEPLOY = "apps/v1/deployments"
POD = "v1/pods"
INTERVAL = 0.25  # the operator's scrape interval in these tests
SLOW = 60.0  # waits that involve model work on a loaded 2-core machine
# Long enough to outlast the 4 s scale-down delay with room on a fast machine (about 10 s at
# 200 tokens/s); 50 s at 40 tokens/s on a loaded 2-core one.
LONG_TOKENS = 2000
# A burst's requests must keep a queue for several scrape windows even where the engine is fast:
# two rows decode at about 150 tokens/s each on 2 cores, so a batch of two takes 1 s or more.
BURST_TOKENS = 160


@pytest.fixture(scope="module")
def ranks() -> Iterator[list[RunningServer]]:
    """Two real servers, one per rank. Two requests run at once per server, so a burst of
    requests queues."""
    args = [
        "--model",
        embedded_model_dir(),
        "--max-running-requests",
        "2",
        "--watchdog-timeout",
        "600",
    ]
    with running_servers([args, args]) as servers:
        yield servers


async def create_rank_pod(
    cluster: Cluster, name: str, rank: int, server: RunningServer, uid: str
) -> None:
    """What the StatefulSet controller and the kubelet would make: a ready pod for `rank`."""
    pod_name = naming.rank_pod_name(name, rank)
    await cluster.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name,
                "namespace": NS,
                "uid": uid,
                "labels": {
                    **naming.labels(name, c.ROLE_RANK),
                    c.POD_INDEX_LABEL: str(rank),
                    c.POD_NAME_LABEL: pod_name,
                },
            },
            "spec": {
                "containers": [
                    {
                        "name": "runtime",
                        "image": "registry.test/berth:1",
                        "ports": [{"name": "http", "containerPort": server.port}],
                    }
                ]
            },
            "status": {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }
    )


def status_of(cluster: Cluster, name: str) -> dict[str, Any]:
    return (cluster.get(ISVC, NS, name) or {}).get("status") or {}


def rank_states(cluster: Cluster, name: str) -> dict[int, str]:
    entries = status_of(cluster, name).get("ranks", [])
    return {entry["rank"]: entry.get("state") for entry in entries}


def event_reasons(cluster: Cluster) -> list[str]:
    return [event.get("reason") for event in posted_events(cluster)]


def operator_metric(metric: str, **labels: str) -> float:
    text = generate_latest(operator_metrics.REGISTRY).decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == metric and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


async def metric_becomes(metric: str, value: float, **labels: str) -> None:
    """The operator records its metrics just after it writes the status: wait for them too."""
    await eventually(lambda: operator_metric(metric, **labels) == value, what=metric)


async def generate(
    client: httpx.AsyncClient, server: RunningServer, max_new_tokens: int
) -> dict[str, Any]:
    body = {
        "text": "Write a long story about a lighthouse keeper:",
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    response = await client.post(f"{server.base_url}/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def sts_replicas(cluster: Cluster, name: str) -> int | None:
    sts = cluster.get(STS, NS, naming.rank_statefulset_name(name))
    return sts["spec"]["replicas"] if sts else None


async def start_ranks(
    cluster: Cluster, name: str, servers: list[RunningServer], uid_prefix: str
) -> None:
    """Play the controllers once the operator has applied the children: one ready pod per
    rank, each on its server; then wait until the operator reports every rank Serving."""
    count = len(servers)
    await eventually(lambda: sts_replicas(cluster, name) == count, what=f"{count} ranks")
    await eventually(lambda: cluster.get(DEPLOY, NS, naming.router_name(name)), what="the router")
    for rank, server in enumerate(servers):
        await create_rank_pod(cluster, name, rank, server, uid=f"{uid_prefix}-{rank}")
    await mark_ready(cluster, name, ranks=count)
    await eventually(
        lambda: rank_states(cluster, name) == dict.fromkeys(range(count), "Serving"),
        what="every rank serving",
    )


async def test_queue_scales_up_and_idle_scales_down_draining_the_rank_first(
    cluster: Cluster, ranks: list[RunningServer]
) -> None:
    name = "scaler"
    spec = {
        "replicas": 1,
        "autoscaling": {
            "enabled": True,
            "minReplicas": 1,
            "maxReplicas": 2,
            "targetQueuePerRank": 1,
            "scaleUpStabilizationSeconds": 1,
            "scaleDownDelaySeconds": 4,
        },
    }
    async with running_operator(cluster, observe_interval=INTERVAL):
        await cluster.create(isvc(name, spec))
        await start_ranks(cluster, name, ranks[:1], "pod-scaler")

        # A burst on rank 0: two run, six wait, far above one queued request per rank.
        async with httpx.AsyncClient() as client:
            burst = [
                asyncio.create_task(generate(client, ranks[0], BURST_TOKENS)) for _ in range(8)
            ]
            await eventually(lambda: sts_replicas(cluster, name) == 2, timeout=SLOW, what="2")
            await eventually(lambda: status_of(cluster, name).get("desiredReplicas") == 2)
            status = status_of(cluster, name)
            assert status["autoscaler"]["reason"] == "ScaleUp"
            assert "queued requests per rank" in status["autoscaler"]["message"]
            assert status["autoscaler"]["lastScaleTime"]
            await eventually(lambda: "ScaledUp" in event_reasons(cluster), what="the Event")
            # The user's spec is never written: GitOps sees no drift.
            assert cluster.get(ISVC, NS, name)["spec"] == spec

            # The StatefulSet controller starts rank 1.
            await create_rank_pod(cluster, name, 1, ranks[1], uid="pod-scaler-1")
            await mark_ready(cluster, name, ranks=2)
            await eventually(lambda: cluster.get(SVC, NS, f"{name}-rank-1"), what="rank 1 svc")
            # The queue on rank 0 empties; the scale-down may come scaleDownDelaySeconds later.
            await eventually(
                lambda: status_of(cluster, name).get("queuedRequests") == 0,
                timeout=SLOW,
                what="the queue to empty",
            )
            # Rank 1 gets a long request now, so it is busy when the scale-down comes.
            long_request = asyncio.create_task(generate(client, ranks[1], LONG_TOKENS))
            results = await asyncio.gather(*burst)
            assert [r["meta_info"]["completion_tokens"] for r in results] == [BURST_TOKENS] * 8

            # Rank 1 leaves routing first, and keeps its pod while it finishes the request.
            await eventually(
                lambda: cluster.get(SVC, NS, f"{name}-rank-1") is None,
                timeout=SLOW,
                what="rank 1 withdrawn",
            )
            assert not long_request.done(), "the scale-down should overlap the running request"
            await eventually(lambda: status_of(cluster, name).get("desiredReplicas") == 1)
            status = status_of(cluster, name)
            assert status["autoscaler"]["reason"] == "ScaleDown"
            assert status["autoscaler"]["drainingRank"] == 1
            assert rank_states(cluster, name)[1] == "Draining"
            while_running = []
            while not long_request.done():
                while_running.append(sts_replicas(cluster, name))
                await asyncio.sleep(0.05)
            # (The last quarter second may already show the removal the finish triggered.)
            assert len(while_running) > 10 and set(while_running[:-5]) == {2}, while_running
            finished = long_request.result()
            assert finished["meta_info"]["completion_tokens"] == LONG_TOKENS  # nothing lost
            await eventually(lambda: sts_replicas(cluster, name) == 1, what="rank 1 removed")
        await eventually(
            lambda: "drainingRank" not in status_of(cluster, name)["autoscaler"], what="drained"
        )
        await eventually(lambda: "RankDrained" in event_reasons(cluster), what="the Event")
        assert "ScaledDown" in event_reasons(cluster)
        await metric_becomes("berth_operator_scale_events_total", 1, name=name, direction="down")
        await metric_becomes("berth_operator_desired_ranks", 1, name=name)
        assert cluster.get(ISVC, NS, name)["spec"] == spec


async def test_frozen_scheduler_is_withdrawn_and_routed_again_when_it_resumes(
    cluster: Cluster, ranks: list[RunningServer]
) -> None:
    name = "frozen"
    spec = {"replicas": 2, "health": {"stallTimeoutSeconds": 2, "restartAfterSeconds": 0}}
    async with running_operator(cluster, observe_interval=INTERVAL):
        await cluster.create(isvc(name, copy.deepcopy(spec)))
        await start_ranks(cluster, name, ranks, "pod-frozen")
        assert reason(cluster, name, "Degraded") == "AsExpected"

        scheduler = scheduler_process(ranks[1])
        scheduler.send_signal(signal.SIGSTOP)
        try:
            stopped_at = time.monotonic()
            await eventually(
                lambda: cluster.get(SVC, NS, f"{name}-rank-1") is None,
                timeout=SLOW,
                what="rank 1 withdrawn",
            )
            # Detection needs the timeout by definition; then one scrape and one apply.
            assert time.monotonic() - stopped_at < 2 + 5
            await eventually(lambda: reason(cluster, name, "Degraded") == "SchedulerStalled")
            degraded = cluster.condition(NS, name, "Degraded")
            assert degraded["status"] == "True"
            assert f"{name}-1" in degraded["message"] and "heartbeat" in degraded["message"]
            assert rank_states(cluster, name)[1] == "Stalled"
            assert cluster.get(SVC, NS, f"{name}-rank-0") is not None  # the healthy rank stays
            await eventually(lambda: "SchedulerStalled" in event_reasons(cluster), what="Event")
            await metric_becomes("berth_operator_stalled_ranks", 1, name=name)
        finally:
            scheduler.send_signal(signal.SIGCONT)

        await eventually(
            lambda: cluster.get(SVC, NS, f"{name}-rank-1") is not None, what="rank 1 routed again"
        )
        await eventually(lambda: reason(cluster, name, "Degraded") == "AsExpected", what="ok")
        assert rank_states(cluster, name)[1] == "Serving"
        await eventually(lambda: "SchedulerRecovered" in event_reasons(cluster), what="Event")
        await metric_becomes("berth_operator_stalls_total", 1, name=name)
        await metric_becomes("berth_operator_rank_restarts_total", 0, name=name)
        assert cluster.get(ISVC, NS, name)["spec"] == spec


async def test_rank_stalled_past_its_grace_is_restarted(
    cluster: Cluster, ranks: list[RunningServer]
) -> None:
    name = "restart"
    spec = {"replicas": 2, "health": {"stallTimeoutSeconds": 1, "restartAfterSeconds": 2}}
    async with running_operator(cluster, observe_interval=INTERVAL):
        await cluster.create(isvc(name, copy.deepcopy(spec)))
        await start_ranks(cluster, name, ranks, "pod-restart")

        scheduler = scheduler_process(ranks[0])
        scheduler.send_signal(signal.SIGSTOP)
        try:
            await eventually(
                lambda: rank_states(cluster, name).get(0) == "Stalled", what="rank 0 stalled"
            )
            await eventually(
                lambda: cluster.get(POD, NS, f"{name}-0") is None,
                timeout=SLOW,
                what="the stalled pod deleted",
            )
            await eventually(lambda: "RankRestarted" in event_reasons(cluster), what="Event")
        finally:
            scheduler.send_signal(signal.SIGCONT)
        # The StatefulSet controller recreates the pod (here: on the resumed server).
        await create_rank_pod(cluster, name, 0, ranks[0], uid="pod-restart-0-new")
        await eventually(lambda: reason(cluster, name, "Degraded") == "AsExpected", what="ok")
        await eventually(lambda: cluster.get(SVC, NS, f"{name}-rank-0") is not None, what="svc")
        await metric_becomes("berth_operator_rank_restarts_total", 1, name=name)
        assert cluster.get(ISVC, NS, name)["spec"] == spec
    # Deleting pods is the one verb only this path uses (tests/cluster/ cannot stall a rank):
    # the role must allow it.
    deletes = [
        r
        for r in cluster.requests()
        if r.method == "DELETE"
        and r.url.path.endswith(f"/pods/{name}-0")
        and not r.headers.get("User-Agent", "").startswith("kmock/")
    ]
    assert deletes
    assert ("", "pods", "delete") in role_rules()


async def test_one_rank_queueing_far_above_the_other_is_reported_as_imbalance(
    cluster: Cluster, ranks: list[RunningServer]
) -> None:
    name = "skewed"
    spec = {"replicas": 2, "health": {"imbalanceWindowSeconds": 2}}
    async with running_operator(cluster, observe_interval=INTERVAL):
        await cluster.create(isvc(name, copy.deepcopy(spec)))
        await start_ranks(cluster, name, ranks, "pod-skewed")
        # Everything goes to rank 1 (as a bad routing key would do): two run, ten wait.
        async with httpx.AsyncClient() as client:
            burst = [
                asyncio.create_task(generate(client, ranks[1], BURST_TOKENS)) for _ in range(12)
            ]
            await eventually(
                lambda: reason(cluster, name, "Degraded") == "RankImbalance",
                timeout=SLOW,
                what="RankImbalance",
            )
            message = cluster.condition(NS, name, "Degraded")["message"]
            assert message.startswith("rank 1 averaged")
            await metric_becomes("berth_operator_rank_imbalance", 1, name=name)
            await asyncio.gather(*burst)
        await eventually(
            lambda: reason(cluster, name, "Degraded") == "AsExpected",
            timeout=SLOW,
            what="balanced again",
        )
        await metric_becomes("berth_operator_rank_imbalance", 0, name=name)
