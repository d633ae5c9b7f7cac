"""Status from the children's real state: readiness, rollouts, failing pods, transitions."""

from __future__ import annotations

import asyncio
import copy
import datetime
import re
from typing import Any

import jsonschema
import pytest

from berth_operator import status
from berth_operator.observer import RankObserver
from berth_operator.plan import RankPlan
from berth_operator.quota import Grant
from berth_operator.scrape import RankSample
from berth_operator.status import Live, Observed

from .factories import SCHEMA, closed, parse

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
    assert conds["Reconciling"] == {**conds["Reconciling"], "status": "False", "reason": "Complete"}
    assert conds["Stalled"]["status"] == "False"
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
    assert conds["Reconciling"]["status"] == "True"
    assert conds["Reconciling"]["reason"] == progress


def test_without_router_only_ranks_count() -> None:
    conds = conditions(
        compute({"routing": {"routerReplicas": 0}}, Observed(statefulset=sts(replicas=1, ready=1)))
    )
    assert conds["Ready"]["status"] == "True"
    assert "no router" in conds["Ready"]["message"]


def test_zero_replicas_is_ready_once_scaled_to_zero() -> None:
    # Reconciled to what was asked for: kstatus reads Current (Argo CD's check says Suspended).
    result = compute(
        {"replicas": 0},
        Observed(statefulset=sts(replicas=0, ready=0), router=deploy(replicas=1, ready=1)),
    )
    assert conditions(result)["Ready"]["status"] == "True"
    assert conditions(result)["Ready"]["reason"] == "ScaledToZero"
    assert conditions(result)["Reconciling"]["reason"] == "Complete"
    still_there = compute(
        {"replicas": 0},
        Observed(statefulset=sts(replicas=1, ready=1), router=deploy(replicas=1, ready=1)),
    )
    assert conditions(still_there)["Ready"]["status"] == "False"


def test_a_deleted_child_is_named_until_it_is_restored() -> None:
    observed = Observed(statefulset=sts(replicas=1, ready=1), router=deploy(replicas=1, ready=1))
    result = status.compute(
        parse({}), observed, None, generation=7, now=NOW, missing=["Service chat-rank-0"]
    )
    conds = conditions(result)
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["reason"] == "ChildrenMissing"
    assert conds["Ready"]["message"] == "restoring Service chat-rank-0"
    assert conds["Reconciling"]["status"] == "True"


def test_the_routers_own_replica_count_counts_once_an_hpa_owns_it() -> None:
    router = deploy(replicas=3, ready=3)
    router["spec"] = {"replicas": 3}  # an HPA scaled it; the spec says 1
    result = compute({}, Observed(statefulset=sts(replicas=1, ready=1), router=router))
    assert conditions(result)["Ready"]["status"] == "True"
    assert "router 3/3 ready" in conditions(result)["Ready"]["message"]


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
        "Reconciling",
        "Stalled",
        "Degraded",
        "SchedulerStalled",
    ]


def test_conditions_of_earlier_operator_versions_go() -> None:
    old = {"type": "Progressing", "status": "True", "reason": "Creating", "message": ""}
    result = compute({}, Observed(), previous={"conditions": [old]})
    assert "Progressing" not in [c["type"] for c in result["conditions"]]


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
    # kstatus: Stalled (Failed at once), not Reconciling.
    assert conds["Stalled"]["status"] == "True"
    assert conds["Stalled"]["message"] == "spec.replicas: bad"
    assert conds["Reconciling"]["status"] == "False"
    assert conds["Reconciling"]["message"] == "not applied; fix the spec"
    assert result["observedGeneration"] == 8
    assert all(c["observedGeneration"] == 8 for c in result["conditions"])
    assert result["readyReplicas"] == 1  # the last good children still run


def test_a_failure_being_retried_is_reconciling_not_stalled() -> None:
    result = status.failed(
        "ApplyFailed", "500: etcd is away", None, generation=3, now=NOW, retrying=True
    )
    conds = conditions(result)
    assert conds["Ready"]["reason"] == "ApplyFailed"
    assert conds["Reconciling"]["status"] == "True"
    assert conds["Stalled"]["status"] == "False"


def test_messages_are_clipped() -> None:
    result = status.failed("InvalidSpec", "x" * 5000, None, generation=1, now=NOW)
    assert len(conditions(result)["Ready"]["message"]) == status.MAX_MESSAGE_LENGTH


class RecordingKube:
    def __init__(self) -> None:
        self.patches: list[dict[str, Any]] = []

    async def patch_status(
        self, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        self.patches.append(patch)
        return {"metadata": {"name": name}, "status": patch}


def test_publish_writes_only_what_changed() -> None:
    kube = RecordingKube()
    current = {"url": "a", "replicas": 1, "conditions": [{"type": "Ready"}]}
    assert asyncio.run(status.publish(kube, "ns", "n", current, dict(current))) is None  # type: ignore[arg-type]
    assert kube.patches == []
    stored = asyncio.run(status.publish(kube, "ns", "n", current, {**current, "replicas": 2}))  # type: ignore[arg-type]
    assert kube.patches == [{"replicas": 2}]
    assert stored == {"metadata": {"name": "n"}, "status": {"replicas": 2}}


# --- merge patches -------------------------------------------------------------------------------


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies a merge patch."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result


MERGE_CASES = [
    # (current, new, patch)
    ({"a": 1, "b": {"c": 1}}, {"a": 1, "b": {"c": 1}}, {}),
    (
        {"autoscaler": {"reason": "ScaleDown", "drainingRank": 2}},
        {"autoscaler": {"reason": "ScaleDown"}},
        {"autoscaler": {"drainingRank": None}},
    ),
    (
        {"autoscaler": {"reason": "ScaleUp"}},
        {"autoscaler": {"reason": "ScaleDown", "drainingRank": 2}},
        {"autoscaler": {"reason": "ScaleDown", "drainingRank": 2}},
    ),
    ({"a": {"b": {"c": 1, "d": 2}}}, {"a": {"b": {"c": 1}}}, {"a": {"b": {"d": None}}}),
    # Lists are replaced whole, however little changed.
    (
        {"ranks": [{"rank": 0, "queued": 1}, {"rank": 1}]},
        {"ranks": [{"rank": 0, "queued": 2}, {"rank": 1}]},
        {"ranks": [{"rank": 0, "queued": 2}, {"rank": 1}]},
    ),
    ({"ranks": [{"rank": 0}, {"rank": 1}]}, {"ranks": [{"rank": 0}]}, {"ranks": [{"rank": 0}]}),
    # An object that becomes a scalar and back.
    ({"a": {"b": 1}}, {"a": 5}, {"a": 5}),
    ({"a": 5}, {"a": {"b": 1}}, {"a": {"b": 1}}),
    # Keys the new status does not mention are left alone.
    (
        {"conditions": [{"type": "Ready"}], "queuedRequests": 3},
        {"queuedRequests": 4},
        {"queuedRequests": 4},
    ),
    (
        {},
        {"url": "x", "autoscaler": {"reason": "ScaleUp"}},
        {"url": "x", "autoscaler": {"reason": "ScaleUp"}},
    ),
]


@pytest.mark.parametrize(("current", "new", "patch"), MERGE_CASES)
def test_merge_patch(current: dict[str, Any], new: dict[str, Any], patch: dict[str, Any]) -> None:
    before = copy.deepcopy(current)
    assert status.merge_patch(current, new) == patch
    assert current == before  # not modified
    # Applied by the API server, the patch gives the new values and keeps the unmentioned keys.
    assert apply_merge_patch(current, patch) == {**current, **new}


# --- live numbers from the ranks' metrics ------------------------------------------------------

T0 = "2026-01-01T00:00:00Z"
T10 = "2026-01-01T00:00:10Z"
T30 = "2026-01-01T00:00:30Z"


def rank_entry(rank: int, scraped: str = T0, **fields: Any) -> dict[str, Any]:
    entry = {
        "rank": rank,
        "pod": f"chat-{rank}",
        "ready": True,
        "queued": 1,
        "running": 2,
        "tokenUsage": 0.25,
        "genThroughput": 40.0,
        "lastScrape": scraped,
        "state": "Serving",
    }
    return {**entry, **fields}


def live_of(**fields: Any) -> Live:
    values: dict[str, Any] = {
        "desired": 2,
        "ranks": [rank_entry(0), rank_entry(1)],
        "queued": 2,
        "running": 4,
        "kv_usage": 0.456,
    }
    return Live(**{**values, **fields})


READY_2 = Observed(statefulset=sts(replicas=2, ready=2), router=deploy(replicas=1, ready=1))
AUTO_SPEC = {"replicas": 2, "autoscaling": {"enabled": True, "maxReplicas": 4}}


def compute_live(
    live: Live | None,
    *,
    observed: Observed = READY_2,
    previous: Any = None,
    now: str = T0,
    plan: RankPlan | None = None,
    spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return status.compute(
        parse(AUTO_SPEC if spec is None else spec),
        observed,
        previous,
        generation=7,
        now=now,
        plan=plan,
        live=live,
    )


def test_live_numbers_fill_the_status() -> None:
    scaler = {"lastScaleTime": T0, "reason": "ScaleUp", "message": "m"}
    result = compute_live(live_of(autoscaler=scaler))
    assert result["queuedRequests"] == 2
    assert result["runningRequests"] == 4
    assert result["kvUsage"] == "46%"
    assert result["ranks"] == [rank_entry(0), rank_entry(1)]
    assert result["autoscaler"] == scaler
    assert result["desiredReplicas"] == 2 and result["readyRanks"] == "2/2"
    assert conditions(result)["Ready"]["status"] == "True"


def test_no_kv_usage_reads_empty_and_no_autoscaler_is_removed() -> None:
    result = compute_live(live_of(kv_usage=None, autoscaler=None))
    assert result["kvUsage"] == ""
    assert result["autoscaler"] is None  # null in the merge patch: removed, if it was there


def test_before_the_first_scrape_the_live_fields_are_not_written() -> None:
    result = compute_live(None)
    for key in ("queuedRequests", "runningRequests", "kvUsage", "ranks", "autoscaler"):
        assert key not in result
    # ... so the publish leaves the last scrape's numbers in place.
    previous = {**result, "queuedRequests": 9, "ranks": [rank_entry(0)]}
    assert status.merge_patch(previous, result) == {}


def test_desired_replicas_come_from_the_autoscaler() -> None:
    # Scaled down to 2: rank 2 drains, so 3 pods still run (and are all ready).
    observed = Observed(statefulset=sts(replicas=3, ready=3), router=deploy(replicas=1, ready=1))
    result = compute_live(
        live_of(desired=2), observed=observed, plan=RankPlan(3, frozenset({2})), spec=AUTO_SPEC
    )
    assert result["desiredReplicas"] == 2
    assert result["replicas"] == 3 and result["readyReplicas"] == 3
    # The rollout is judged against the pods of the plan, not the desired ranks.
    assert conditions(result)["Ready"]["status"] == "True"
    assert conditions(result)["Reconciling"]["reason"] == "Complete"
    # Scaled up to 4, two of them still starting.
    up = compute_live(live_of(desired=4), observed=observed, plan=RankPlan(4))
    assert up["desiredReplicas"] == 4 and up["readyRanks"] == "3/4"
    assert conditions(up)["Ready"]["reason"] == "RanksNotReady"
    assert conditions(up)["Reconciling"]["status"] == "True"


def test_an_autoscaler_scale_up_reads_as_scaling() -> None:
    observed = Observed(statefulset=sts(replicas=3, ready=3), router=deploy(replicas=1, ready=1))
    up = compute_live(live_of(desired=4), observed=observed, plan=RankPlan(4))
    assert conditions(up)["Reconciling"]["reason"] == "Scaling"


STALLED = {1: "rank 1 (chat-1): scheduler heartbeat has not moved for 31s"}
IMBALANCE = "rank 0 averaged 9.0 queued requests over 60s, the other ranks 1.0: check ..."
CRASHING = pod("chat-0", containerStatuses=[waiting("runtime", "CrashLoopBackOff")])


@pytest.mark.parametrize(
    ("stalled", "imbalance", "pods", "reason", "message"),
    [
        ({}, None, [], "AsExpected", "no failing pods, no stalled rank"),
        ({}, IMBALANCE, [], "RankImbalance", IMBALANCE),
        (
            STALLED,
            None,
            [],
            "SchedulerStalled",
            f"{STALLED[1]}; withdrawn from routing until it recovers",
        ),
        (
            STALLED,
            IMBALANCE,
            [],
            "SchedulerStalled",
            f"{STALLED[1]}; withdrawn from routing until it recovers",
        ),
        (
            {**STALLED, 2: "rank 2 (chat-2): 1 running and 0 queued requests, but no step"},
            None,
            [],
            "SchedulerStalled",
            f"{STALLED[1]}; rank 2 (chat-2): 1 running and 0 queued requests, but no step; "
            "withdrawn from routing until it recovers",
        ),
        ({}, IMBALANCE, [CRASHING], "PodsFailing", "chat-0/runtime: CrashLoopBackOff"),
        (
            STALLED,
            IMBALANCE,
            [CRASHING],
            "PodsFailing",
            f"chat-0/runtime: CrashLoopBackOff; {STALLED[1]}",
        ),
    ],
)
def test_degraded_reasons_and_their_precedence(
    stalled: dict[int, str],
    imbalance: str | None,
    pods: list[dict[str, Any]],
    reason: str,
    message: str,
) -> None:
    observed = Observed(
        statefulset=sts(replicas=2, ready=2), router=deploy(replicas=1, ready=1), pods=pods
    )
    result = compute_live(live_of(stalled=stalled, imbalance=imbalance), observed=observed)
    degraded = conditions(result)["Degraded"]
    assert degraded["status"] == ("False" if reason == "AsExpected" else "True")
    assert degraded["reason"] == reason
    assert degraded["message"] == message


def test_a_steady_rank_keeps_its_last_scrape_so_nothing_is_rewritten() -> None:
    first = compute_live(live_of(), now=T0)
    again = compute_live(
        live_of(ranks=[rank_entry(0, T10), rank_entry(1, T10)]), previous=first, now=T10
    )
    assert [r["lastScrape"] for r in again["ranks"]] == [T0, T0]
    assert again == first
    assert status.merge_patch(first, again) == {}


def test_last_scrape_moves_when_the_numbers_do() -> None:
    first = compute_live(live_of(), now=T0)
    again = compute_live(
        live_of(ranks=[rank_entry(0, T10, queued=3), rank_entry(1, T10)]),
        previous=first,
        now=T10,
    )
    assert [r["lastScrape"] for r in again["ranks"]] == [T10, T0]
    assert again["ranks"][0]["queued"] == 3
    # State changes count as well.
    stalled = compute_live(
        live_of(ranks=[rank_entry(0, T10), rank_entry(1, T10, state="Stalled", message="x")]),
        previous=first,
        now=T10,
    )
    assert [r["lastScrape"] for r in stalled["ranks"]] == [T0, T10]


def test_a_steady_rank_is_never_rewritten_however_long_it_stays_steady() -> None:
    first = compute_live(live_of(), now=T0)
    much_later = compute_live(
        live_of(ranks=[rank_entry(0, T30), rank_entry(1, T30)]), previous=first, now=T30
    )
    assert [r["lastScrape"] for r in much_later["ranks"]] == [T0, T0]
    assert status.merge_patch(first, much_later) == {}


def test_an_unreachable_rank_keeps_its_message_while_it_stays_unreachable() -> None:
    def unreachable(message: str) -> dict[str, Any]:
        return {
            "rank": 0,
            "pod": "chat-0",
            "ready": True,
            "state": "Unreachable",
            "message": message,
        }

    first = compute_live(live_of(ranks=[unreachable("ConnectTimeout: timed out")]), now=T0)
    again = compute_live(
        live_of(ranks=[unreachable("ConnectError: [Errno 111] refused")]), previous=first, now=T10
    )
    assert status.merge_patch(first, again) == {}
    back = compute_live(live_of(ranks=[rank_entry(0, T10)]), previous=first, now=T10)
    assert back["ranks"][0]["state"] == "Serving"


def test_last_scrape_without_a_usable_earlier_entry_is_the_new_one() -> None:
    previous = {
        "ranks": [
            rank_entry(0, "not a time"),  # unreadable: refreshed
            {k: v for k, v in rank_entry(1).items() if k != "lastScrape"},  # had none
            "garbage",
        ]
    }
    live = live_of(ranks=[rank_entry(0, T10), rank_entry(1, T10), rank_entry(2, T10)])
    result = compute_live(live, previous=previous, now=T10)
    assert [r["lastScrape"] for r in result["ranks"]] == [T10, T10, T10]
    # An unreachable rank has no lastScrape; the earlier one is not carried over.
    gone = {k: v for k, v in rank_entry(0, T10).items() if k != "lastScrape"}
    result = compute_live(live_of(ranks=[gone]), previous=compute_live(live_of()), now=T10)
    assert "lastScrape" not in result["ranks"][0]


# --- the status against the CRD's status schema -------------------------------------------------

RFC3339_DATE_TIME = re.compile(
    r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})"
)
FORMATS = jsonschema.FormatChecker(formats=())


@FORMATS.checks("date-time", raises=ValueError)
def _date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    if not RFC3339_DATE_TIME.fullmatch(value):
        return False
    datetime.datetime.fromisoformat(value.replace("z", "Z").replace("Z", "+00:00"))
    return True


def validate_status(value: dict[str, Any]) -> None:
    schema = closed(SCHEMA["properties"]["status"])
    jsonschema.Draft4Validator(schema, format_checker=FORMATS).validate(value)


BASE = 1_767_225_600.0  # T0


def observed_sample(rank: int, t: float, **fields: Any) -> RankSample:
    values: dict[str, Any] = {
        "rank": rank,
        "pod": f"chat-{rank}",
        "uid": f"uid-{rank}",
        "time": BASE + t,
        "ready": True,
        "ok": True,
        "heartbeat": BASE + t,
        "steps": t,
        "generated_tokens": 10 * t,
    }
    return RankSample(**{**values, **fields})


def full_live_status() -> dict[str, Any]:
    """The status of six ranks in every state, with the autoscaler draining rank 5."""
    spec = {
        "replicas": 2,
        "autoscaling": {"enabled": True, "maxReplicas": 6},
        "health": {"stallTimeoutSeconds": 10, "imbalanceWindowSeconds": 10},
    }
    isvc = parse(spec)
    observer = RankObserver.from_status(
        {
            "desiredReplicas": 5,
            "autoscaler": {
                "lastScaleTime": T0,
                "reason": "ScaleDown",
                "message": "no queued requests",
                "drainingRank": 5,
            },
        }
    )
    for t in range(0, 12, 2):
        observer.observe(
            isvc,
            [
                observed_sample(0, t, heartbeat=BASE - 1, queued=2),  # stalled
                observed_sample(1, t, ok=False, error="ReadTimeout"),
                # rank 2: no pod with an address yet
                observed_sample(3, t, ready=False),
                observed_sample(4, t, queued=12, running=8, token_usage=0.61, gen_throughput=99.9),
                observed_sample(5, t, running=1, token_usage=0.05),  # draining
            ],
            BASE + t,
        )
    live = observer.live(isvc)
    assert [r["state"] for r in live.ranks] == [
        "Stalled",
        "Unreachable",
        "Starting",
        "Starting",
        "Serving",
        "Draining",
    ]
    assert live.imbalance is not None and live.stalled
    return status.compute(
        isvc,
        Observed(statefulset=sts(replicas=6, ready=3), router=deploy(replicas=1, ready=1)),
        None,
        generation=3,
        now=T10,
        plan=observer.plan(isvc),
        live=live,
    )


def test_a_full_live_status_is_valid_for_the_crd() -> None:
    result = full_live_status()
    assert {"ranks", "autoscaler", "queuedRequests", "kvUsage"} <= result.keys()
    assert result["autoscaler"]["drainingRank"] == 5
    assert result["desiredReplicas"] == 5
    assert conditions(result)["Degraded"]["reason"] == "SchedulerStalled"
    validate_status(result)


@pytest.mark.parametrize(
    "breakage",
    [
        lambda s: s["ranks"][0].update(state="Frozen"),
        lambda s: s["ranks"][4].update(lastScrape="yesterday"),
        lambda s: s["ranks"][4].update(lastScrape="2026-13-01T00:00:00Z"),
        lambda s: s["ranks"][4].update(queued="12"),
        lambda s: s["autoscaler"].update(lastScaleTime="2026-01-01 00:00:00"),
        lambda s: s["autoscaler"].update(unknown=1),
        lambda s: s.update(kvUsage=0.5),
        lambda s: s["ranks"].append({"pod": "chat-9"}),
    ],
)
def test_the_crd_check_catches_a_bad_status(breakage: Any) -> None:
    result = full_live_status()
    breakage(result)
    with pytest.raises(jsonschema.ValidationError):
        validate_status(result)


def test_turning_autoscaling_off_removes_the_autoscaler_status() -> None:
    scaler = {"lastScaleTime": T0, "reason": "ScaleDown", "message": "m", "drainingRank": 2}
    before = compute_live(live_of(autoscaler=scaler))
    off = {"replicas": 2, "autoscaling": {"enabled": False}}
    after = compute_live(live_of(autoscaler=None), previous=before, now=T10, spec=off)
    written = apply_merge_patch(before, status.merge_patch(before, after))
    assert "autoscaler" not in written


def test_a_quota_held_service_serves_its_granted_ranks_and_the_autoscaler_says_why() -> None:
    limit = "pool h100: limits.maxAccelerators is 2; 2 of 4 ranks fit (2 claimed)"
    grant = Grant((("h100", 2),), ranks=2, wanted=4, limit=limit)
    live = Live(desired=4, autoscaler={"reason": "ScaleUp", "message": "queue 9/rank"})
    result = status.compute(
        parse({"replicas": 1, "autoscaling": {"enabled": True}, "pools": [{"name": "h100"}]}),
        Observed(statefulset=sts(replicas=2, ready=2), router=deploy(replicas=1, ready=1)),
        None,
        generation=7,
        now=NOW,
        plan=RankPlan(2),
        live=live,
        grant=grant,
    )
    ready = conditions(result)["Ready"]
    assert (ready["status"], ready["reason"]) == ("True", "QuotaExceeded")
    assert ready["message"] == f"2/4 ranks ready; router 1/1 ready; {limit}"
    assert (result["desiredReplicas"], result["readyRanks"]) == (4, "2/4")
    assert result["pools"] == [{"pool": "h100", "ranks": 2}]
    assert result["autoscaler"] == {
        "reason": "QuotaExceeded",
        "message": f"held at 2 ranks: {limit}",
    }
    jsonschema.Draft4Validator(closed(SCHEMA["properties"]["status"])).validate(result)
    # Nothing granted at all: not ready, same reason.
    none = status.compute(
        parse({"replicas": 1, "pools": [{"name": "h100"}]}),
        Observed(statefulset=sts(replicas=0, ready=0), router=deploy(replicas=1, ready=1)),
        None,
        generation=7,
        now=NOW,
        plan=RankPlan(0),
        grant=Grant((("h100", 0),), ranks=0, wanted=1, limit=limit),
    )
    assert (conditions(none)["Ready"]["status"], conditions(none)["Ready"]["reason"]) == (
        "False",
        "QuotaExceeded",
    )
