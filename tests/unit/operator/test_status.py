"""Status from the children's real state: readiness, rollouts, failing pods, transitions."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from berth_operator import status
from berth_operator.status import Observed

from .factories import parse

NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:05:00Z"


def sts(
    *,
    replicas: int,
    ready: int,
    updated: int | None = None,
    generation: int = 2,
    observed: int = 2,
    current_rev: str = "r2",
    update_rev: str = "r2",
) -> dict[str, Any]:
    return {
        "metadata": {"name": "chat", "generation": generation},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas if updated is None else updated,
            "currentRevision": current_rev,
            "updateRevision": update_rev,
        },
    }


def deploy(*, replicas: int, ready: int, generation: int = 1) -> dict[str, Any]:
    return {
        "metadata": {"name": "chat-router", "generation": generation},
        "status": {
            "observedGeneration": generation,
            "replicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": replicas,
        },
    }


def conditions(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in result["conditions"]}


def compute(spec: dict[str, Any], observed: Observed, previous: Any = None, now: str = NOW):
    return status.compute(parse(spec), observed, previous, generation=7, now=now)


def test_all_ranks_and_router_ready_is_ready() -> None:
    result = compute(
        {"replicas": 2},
        Observed(statefulset=sts(replicas=2, ready=2), router=deploy(replicas=1, ready=1)),
    )
    conds = conditions(result)
    assert conds["Ready"]["status"] == "True"
    assert conds["Ready"]["reason"] == "Ready"
    assert "http://chat.team-a.svc/v1" in conds["Ready"]["message"]
    assert conds["Progressing"] == {**conds["Progressing"], "status": "False", "reason": "Complete"}
    assert conds["Degraded"]["status"] == "False"
    assert all(c["observedGeneration"] == 7 for c in result["conditions"])
    assert result["observedGeneration"] == 7
    assert result["readyReplicas"] == 2 and result["replicas"] == 2
    assert result["readyRanks"] == "2/2"
    assert result["routerReadyReplicas"] == 1
    assert result["url"] == result["clusterURL"] == "http://chat.team-a.svc/v1"
    assert (
        result["selector"]
        == "serving.berth.dev/component=rank,serving.berth.dev/inferenceservice=chat"
    )


@pytest.mark.parametrize(
    ("observed", "reason", "progress"),
    [
        (Observed(), "RanksNotReady", "Creating"),
        (
            Observed(
                statefulset=sts(replicas=0, ready=0, observed=1), router=deploy(replicas=1, ready=1)
            ),
            "RanksNotReady",
            "Creating",
        ),
        (
            Observed(statefulset=sts(replicas=2, ready=1), router=deploy(replicas=1, ready=1)),
            "RanksNotReady",
            "Starting",
        ),
        (
            Observed(
                statefulset=sts(replicas=2, ready=2, updated=1, current_rev="r1"),
                router=deploy(replicas=1, ready=1),
            ),
            "RolloutInProgress",
            "RollingUpdate",
        ),
        (
            # The StatefulSet controller has not seen the newest spec yet.
            Observed(
                statefulset=sts(replicas=2, ready=2, generation=3, observed=2),
                router=deploy(replicas=1, ready=1),
            ),
            "RolloutInProgress",
            "RollingUpdate",
        ),
        (
            Observed(statefulset=sts(replicas=3, ready=3), router=deploy(replicas=1, ready=1)),
            "RolloutInProgress",
            "Scaling",
        ),
        (
            Observed(statefulset=sts(replicas=2, ready=2), router=deploy(replicas=1, ready=0)),
            "RouterNotReady",
            "Starting",
        ),
        (Observed(statefulset=sts(replicas=2, ready=2), router=None), "RouterNotReady", "Starting"),
    ],
)
def test_not_ready_reasons(observed: Observed, reason: str, progress: str) -> None:
    conds = conditions(compute({"replicas": 2}, observed))
    assert conds["Ready"]["status"] == "False"
    assert conds["Ready"]["reason"] == reason
    assert conds["Progressing"]["status"] == "True"
    assert conds["Progressing"]["reason"] == progress


def test_without_router_only_ranks_count() -> None:
    conds = conditions(
        compute({"routing": {"routerReplicas": 0}}, Observed(statefulset=sts(replicas=1, ready=1)))
    )
    assert conds["Ready"]["status"] == "True"
    assert "no router" in conds["Ready"]["message"]


def test_zero_replicas_is_not_ready() -> None:
    result = compute(
        {"replicas": 0},
        Observed(statefulset=sts(replicas=0, ready=0), router=deploy(replicas=1, ready=1)),
    )
    assert conditions(result)["Ready"]["reason"] == "NoRanks"
    assert conditions(result)["Progressing"]["reason"] == "Complete"


def pod(name: str, **status_fields: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": status_fields}


def waiting(container: str, reason: str, message: str = "", **extra: Any) -> dict[str, Any]:
    state: dict[str, Any] = {"waiting": {"reason": reason}}
    if message:
        state["waiting"]["message"] = message
    return {"name": container, "state": state, **extra}


def test_failing_pods_make_it_degraded_and_say_which_and_why() -> None:
    pods = [
        pod(
            "chat-1",
            phase="Running",
            containerStatuses=[
                waiting(
                    "runtime",
                    "CrashLoopBackOff",
                    lastState={"terminated": {"reason": "OOMKilled", "exitCode": 137}},
                )
            ],
        ),
        pod(
            "chat-0",
            phase="Pending",
            containerStatuses=[
                waiting("runtime", "CreateContainerConfigError", 'secret "chat-key" not found')
            ],
        ),
        pod(
            "chat-2",
            phase="Pending",
            conditions=[
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                }
            ],
        ),
        pod(
            "chat-3",
            phase="Pending",
            initContainerStatuses=[waiting("model-download", "ImagePullBackOff")],
        ),
        # Loading a model is not a failure.
        pod(
            "chat-4",
            phase="Running",
            containerStatuses=[{"name": "runtime", "state": {"running": {}}}],
        ),
        pod("chat-5", phase="Pending", containerStatuses=[waiting("runtime", "ContainerCreating")]),
    ]
    result = compute({"replicas": 6}, Observed(statefulset=sts(replicas=6, ready=1), pods=pods))
    degraded = conditions(result)["Degraded"]
    assert degraded["status"] == "True"
    assert degraded["reason"] == "PodsFailing"
    assert degraded["message"].split("; ") == [
        'chat-0/runtime: CreateContainerConfigError: secret "chat-key" not found',
        "chat-1/runtime: CrashLoopBackOff: last exit: OOMKilled (code 137)",
        "chat-2: Unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
        "chat-3/model-download: ImagePullBackOff",
    ]


def test_terminating_pods_are_not_failures() -> None:
    gone = pod("chat-0", containerStatuses=[waiting("runtime", "CrashLoopBackOff")])
    gone["metadata"]["deletionTimestamp"] = NOW
    assert status.pod_problems([gone]) == []


def test_transition_time_moves_only_when_the_status_flips() -> None:
    observed = Observed(statefulset=sts(replicas=1, ready=0), router=deploy(replicas=1, ready=1))
    first = compute({}, observed, now=NOW)
    again = compute({}, observed, previous=first, now=LATER)
    assert again == first  # nothing changed: byte-identical, so nothing is written
    flipped = compute(
        {},
        Observed(statefulset=sts(replicas=1, ready=1), router=deploy(replicas=1, ready=1)),
        previous=first,
        now=LATER,
    )
    assert conditions(flipped)["Ready"]["lastTransitionTime"] == LATER
    assert conditions(flipped)["Degraded"]["lastTransitionTime"] == NOW  # still False


def test_conditions_of_other_writers_are_kept() -> None:
    foreign = {"type": "SchedulerStalled", "status": "True", "reason": "x", "message": "y"}
    result = compute({}, Observed(), previous={"conditions": [foreign]})
    assert [c["type"] for c in result["conditions"]] == [
        "Ready",
        "Progressing",
        "Degraded",
        "SchedulerStalled",
    ]


def test_ingress_address_becomes_the_url() -> None:
    ingress = {"status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.9"}]}}}
    result = compute({"ingress": {}}, Observed(ingress=ingress))
    assert result["url"] == "http://203.0.113.9/v1"
    assert result["clusterURL"] == "http://chat.team-a.svc/v1"
    with_host = compute({"ingress": {"host": "a.example.com"}}, Observed())
    assert with_host["url"] == "http://a.example.com/v1"


def test_failed_generation_keeps_the_rest_of_the_status() -> None:
    previous = compute(
        {}, Observed(statefulset=sts(replicas=1, ready=1), router=deploy(replicas=1, ready=1))
    )
    result = status.failed("InvalidSpec", "spec.replicas: bad", previous, generation=8, now=LATER)
    conds = conditions(result)
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["reason"] == "InvalidSpec"
    assert conds["Ready"]["message"] == "spec.replicas: bad"
    assert conds["Degraded"]["status"] == "True"
    assert conds["Progressing"]["message"] == "not applied; fix the spec"
    assert result["observedGeneration"] == 8
    assert result["readyReplicas"] == 1  # the last good children still run
    assert status.sticky_failure(result, 8)
    assert not status.sticky_failure(result, 9)
    assert not status.sticky_failure(previous, 7)


def test_messages_are_clipped() -> None:
    result = status.failed("InvalidSpec", "x" * 5000, None, generation=1, now=NOW)
    assert len(conditions(result)["Ready"]["message"]) == status.MAX_MESSAGE_LENGTH


class RecordingKube:
    def __init__(self) -> None:
        self.patches: list[dict[str, Any]] = []

    async def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.patches.append(patch)


def test_publish_writes_only_what_changed() -> None:
    kube = RecordingKube()
    current = {"url": "a", "replicas": 1, "conditions": [{"type": "Ready"}]}
    assert not asyncio.run(status.publish(kube, "ns", "n", current, dict(current)))  # type: ignore[arg-type]
    assert kube.patches == []
    assert asyncio.run(status.publish(kube, "ns", "n", current, {**current, "replicas": 2}))  # type: ignore[arg-type]
    assert kube.patches == [{"replicas": 2}]
