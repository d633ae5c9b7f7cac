"""The operator's lifecycle against an emulated API: create, observe, update, reject, delete."""

from __future__ import annotations

import copy
import logging
from typing import Any

import attrs
import kmock
import pytest

from berth_operator import builders
from berth_operator import constants as c
from berth_operator.spec import InferenceService

from .conftest import ISVC, Cluster, eventually, running_operator

NS = "team-a"
STS = "apps/v1/statefulsets"
DEPLOY = "apps/v1/deployments"
SVC = "v1/services"
PDB = "policy/v1/poddisruptionbudgets"
ING = "networking.k8s.io/v1/ingresses"
SA = "v1/serviceaccounts"
ROLE = "rbac.authorization.k8s.io/v1/roles"
RB = "rbac.authorization.k8s.io/v1/rolebindings"
RESOURCE_OF_KIND = {
    "StatefulSet": STS,
    "Deployment": DEPLOY,
    "Service": SVC,
    "PodDisruptionBudget": PDB,
    "Ingress": ING,
    "ServiceAccount": SA,
    "Role": ROLE,
    "RoleBinding": RB,
}
IMAGE = "registry.test/berth:1"


def isvc(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "metadata": {"name": name, "namespace": NS, "generation": 1},
        "spec": copy.deepcopy(spec),
    }


def expected_children(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    body = cluster.get(ISVC, NS, name)
    assert body is not None
    return builders.build_children(InferenceService.from_body(body, default_image=IMAGE))


def child_names(cluster: Cluster) -> dict[str, list[str]]:
    return {r: cluster.names(r, NS) for r in (STS, DEPLOY, SVC, PDB, ING, SA, ROLE, RB)}


def content(obj: dict[str, Any]) -> dict[str, Any]:
    """What an object says besides its identity: spec, or rules / roleRef / subjects."""
    return {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata", "status")}


def reason(cluster: Cluster, name: str, type_: str = "Ready") -> str | None:
    return cluster.condition(NS, name, type_).get("reason")


async def mark_ready(cluster: Cluster, name: str, ranks: int, routers: int = 1) -> None:
    """Play the StatefulSet and Deployment controllers: every pod up and ready."""
    await cluster.patch_status(
        STS,
        NS,
        name,
        {
            "replicas": ranks,
            "readyReplicas": ranks,
            "updatedReplicas": ranks,
            "currentRevision": "r1",
            "updateRevision": "r1",
        },
    )
    if routers:
        await cluster.patch_status(
            DEPLOY,
            NS,
            builders.router_name(name),
            {"replicas": routers, "readyReplicas": routers, "updatedReplicas": routers},
        )


def posted_events(cluster: Cluster, since: int = 0) -> list[dict[str, Any]]:
    return [
        r.data
        for r in cluster.requests(since)
        if r.method == "POST" and r.url.path.endswith("/events")
    ]


async def test_create_applies_every_child_and_reports_status_from_them(
    cluster: Cluster, operator: None
) -> None:
    spec = {"replicas": 2, "apiKeySecretRef": {"name": "chat-key"}}
    await cluster.create(isvc("chat", spec))

    expected = await eventually(lambda: expected_children(cluster, "chat"))
    for child in expected:
        resource = RESOURCE_OF_KIND[child["kind"]]
        stored = await eventually(
            lambda child=child, resource=resource: cluster.get(
                resource, NS, child["metadata"]["name"]
            ),
            what=f"{child['kind']} {child['metadata']['name']}",
        )
        assert content(stored) == content(child)
        assert stored["metadata"]["ownerReferences"][0]["uid"] == "uid-inferenceservice-chat"
    assert child_names(cluster) == {
        STS: ["chat"],
        DEPLOY: ["chat-router"],
        SVC: ["chat", "chat-rank-0", "chat-rank-1", "chat-ranks"],
        PDB: ["chat", "chat-router"],
        ING: [],
        SA: ["chat-router"],
        ROLE: ["chat-router"],
        RB: ["chat-router"],
    }

    # Applied is not ready: nothing runs yet.
    await eventually(lambda: reason(cluster, "chat") == "RanksNotReady", what="RanksNotReady")
    status = cluster.get(ISVC, NS, "chat")["status"]
    assert status["observedGeneration"] == 1
    assert status["url"] == "http://chat.team-a.svc/v1"
    assert status["readyRanks"] == "0/2"
    assert cluster.condition(NS, "chat", "Progressing")["status"] == "True"
    assert any(e["reason"] == "Applied" for e in posted_events(cluster))

    # The children's controllers report progress; the operator follows them.
    await cluster.patch_status(STS, NS, "chat", {"replicas": 2, "readyReplicas": 1})
    await eventually(
        lambda: cluster.get(ISVC, NS, "chat")["status"]["readyRanks"] == "1/2", what="1/2"
    )
    assert reason(cluster, "chat") == "RanksNotReady"
    await mark_ready(cluster, "chat", ranks=2)
    await eventually(lambda: reason(cluster, "chat") == "Ready", what="Ready")
    ready = cluster.condition(NS, "chat", "Ready")
    assert ready["status"] == "True" and ready["observedGeneration"] == 1
    assert cluster.condition(NS, "chat", "Progressing")["reason"] == "Complete"
    assert cluster.condition(NS, "chat", "Degraded")["status"] == "False"
    # The user's spec is exactly what the user wrote; kopf's bookkeeping is in our annotations.
    body = cluster.get(ISVC, NS, "chat")
    assert body["spec"] == spec
    annotations = body["metadata"].get("annotations", {})
    assert annotations and all(k.startswith(f"{c.ANNOTATION_PREFIX}/") for k in annotations)
    assert "kopf" not in body["status"]
    spec_writes = [
        r
        for r in cluster.requests()
        if r.method == "PATCH"
        and r.resource is not None
        and r.resource.plural == c.PLURAL
        and not r.subresource
        and not r.headers.get("User-Agent", "").startswith("kmock/")
    ]
    assert spec_writes and all("spec" not in (r.data or {}) for r in spec_writes)


async def test_a_crash_looping_rank_makes_it_degraded(cluster: Cluster, operator: None) -> None:
    await cluster.create(isvc("chat", {}))
    await eventually(lambda: cluster.get(STS, NS, "chat"))
    labels = {
        **builders.labels("chat", c.ROLE_RANK),
        c.POD_INDEX_LABEL: "0",
    }
    await cluster.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "chat-0", "namespace": NS, "labels": labels},
            "status": {
                "phase": "Running",
                "containerStatuses": [
                    {
                        "name": "runtime",
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        "lastState": {"terminated": {"reason": "Error", "exitCode": 1}},
                    }
                ],
            },
        }
    )
    await eventually(lambda: reason(cluster, "chat", "Degraded") == "PodsFailing")
    message = cluster.condition(NS, "chat", "Degraded")["message"]
    assert message == "chat-0/runtime: CrashLoopBackOff: last exit: Error (code 1)"


async def test_spec_update_rolls_the_ranks_and_prunes_what_is_gone(
    cluster: Cluster, operator: None
) -> None:
    await cluster.create(isvc("chat", {"replicas": 3, "ingress": {"host": "chat.example.com"}}))
    await eventually(lambda: cluster.get(ING, NS, "chat"), what="the Ingress")
    await eventually(lambda: len(cluster.names(SVC, NS)) == 5, what="5 Services")
    await mark_ready(cluster, "chat", ranks=3)
    await eventually(lambda: reason(cluster, "chat") == "Ready")
    assert cluster.get(ISVC, NS, "chat")["status"]["url"] == "http://chat.example.com/v1"

    await cluster.update_spec(
        NS,
        "chat",
        {
            "replicas": 1,
            "routing": {"routerReplicas": 0},
            "ingress": None,
            "runtime": {"args": {"maxRunningRequests": 8}},
        },
    )

    def rolled() -> bool:
        sts = cluster.get(STS, NS, "chat")
        args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
        return sts["spec"]["replicas"] == 1 and "--max-running-requests" in args

    await eventually(rolled, what="the StatefulSet update")
    await eventually(
        lambda: (
            child_names(cluster)
            == {
                STS: ["chat"],
                DEPLOY: [],
                SVC: ["chat", "chat-rank-0", "chat-ranks"],
                PDB: ["chat"],
                ING: [],
                SA: [],
                ROLE: [],
                RB: [],
            }
        ),
        what="pruned children",
    )
    entry = cluster.get(SVC, NS, "chat")
    assert entry["spec"]["selector"][c.LABEL_ROLE] == c.ROLE_RANK  # no router: straight to ranks
    # The StatefulSet controller has not caught up with the new spec: not ready, rolling.
    await eventually(lambda: cluster.get(ISVC, NS, "chat")["status"]["observedGeneration"] == 2)
    await mark_ready(cluster, "chat", ranks=1, routers=0)
    await eventually(lambda: reason(cluster, "chat") == "Ready")
    status = cluster.get(ISVC, NS, "chat")["status"]
    assert status["url"] == "http://chat.team-a.svc/v1"
    assert status["readyRanks"] == "1/1"
    assert all(cond["observedGeneration"] == 2 for cond in status["conditions"])


async def test_prune_leaves_lookalikes_it_does_not_own_alone(
    cluster: Cluster, operator: None
) -> None:
    # Same labels as chat's children, but owned by something else (or nothing).
    for name, owners in (("chat-rank-7", [{"uid": "someone-else"}]), ("chat-extra", None)):
        meta: dict[str, Any] = {"name": name, "namespace": NS, "labels": builders.labels("chat")}
        if owners:
            meta["ownerReferences"] = [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "x", **owners[0]}
            ]
        await cluster.create({"apiVersion": "v1", "kind": "Service", "metadata": meta})
    await cluster.create(isvc("chat", {"replicas": 2}))
    await eventually(lambda: reason(cluster, "chat") == "RanksNotReady")
    await cluster.update_spec(NS, "chat", {"replicas": 1})
    await eventually(lambda: cluster.get(SVC, NS, "chat-rank-1") is None, what="rank-1 pruned")
    assert cluster.names(SVC, NS) == [
        "chat",
        "chat-extra",
        "chat-rank-0",
        "chat-rank-7",
        "chat-ranks",
    ]


async def test_invalid_spec_creates_nothing_and_says_what_to_fix(
    cluster: Cluster, operator: None
) -> None:
    await cluster.create(isvc("broken", {"replicas": -1, "model": {"uri": "s3://bucket/llama"}}))
    await eventually(lambda: reason(cluster, "broken") == "InvalidSpec", what="InvalidSpec")
    ready = cluster.condition(NS, "broken", "Ready")
    assert ready["status"] == "False" and ready["observedGeneration"] == 1
    assert "spec.replicas: must be at least 0, got -1" in ready["message"]
    assert "spec.model.uri: 's3://bucket/llama' is not a model URI" in ready["message"]
    assert cluster.condition(NS, "broken", "Degraded")["status"] == "True"
    assert cluster.get(ISVC, NS, "broken")["status"]["observedGeneration"] == 1
    await eventually(
        lambda: any(e["reason"] == "InvalidSpec" for e in posted_events(cluster)),
        what="an InvalidSpec Event",
    )
    event = next(e for e in posted_events(cluster) if e["reason"] == "InvalidSpec")
    assert event["type"] == "Warning"
    assert event["involvedObject"]["name"] == "broken"
    assert "spec.replicas" in event["message"]
    assert child_names(cluster) == {
        STS: [],
        DEPLOY: [],
        SVC: [],
        PDB: [],
        ING: [],
        SA: [],
        ROLE: [],
        RB: [],
    }

    # Fixing the spec brings the service up: the operator did not give up on the resource.
    await cluster.update_spec(NS, "broken", {"replicas": 1, "model": {"uri": None}})
    await eventually(lambda: cluster.get(STS, NS, "broken"), what="the StatefulSet")
    await eventually(lambda: reason(cluster, "broken") == "RanksNotReady")
    assert cluster.get(ISVC, NS, "broken")["status"]["observedGeneration"] == 2


async def test_garbage_specs_never_crash_the_operator(cluster: Cluster, operator: None) -> None:
    await cluster.create(isvc("garbage", {"model": "hf://x", "replicas": "many", "routing": []}))
    await cluster.create(isvc("fine", {}))
    await eventually(lambda: reason(cluster, "garbage") == "InvalidSpec")
    await eventually(lambda: cluster.get(STS, NS, "fine"), what="the other resource's children")
    assert cluster.get(STS, NS, "garbage") is None


@attrs.frozen
class Rejected(kmock.KubernetesError):
    status: int = 422
    reason: str = "Invalid"
    message: str = 'StatefulSet.apps "chat" is invalid: spec.template.spec.affinity: Invalid value'


async def test_a_child_the_api_server_rejects_is_an_invalid_spec_and_nothing_is_applied(
    cluster: Cluster, operator: None
) -> None:
    statefulsets = kmock.resource("apps", "v1", "statefulsets")
    cluster.api["post", statefulsets] << Rejected
    cluster.api["patch", statefulsets] << Rejected
    start = len(cluster.requests())
    await cluster.create(isvc("chat", {}))
    await eventually(lambda: reason(cluster, "chat") == "InvalidSpec", what="InvalidSpec")
    assert (
        "spec.template.spec.affinity: Invalid value"
        in cluster.condition(NS, "chat", "Ready")["message"]
    )
    writes = [
        r
        for r in cluster.requests(start)
        if r.method in ("POST", "PATCH")
        and r.resource is not None
        and r.resource.plural not in ("events", c.PLURAL)
    ]
    assert writes, "the children were at least validated"
    # Everything before the rejected child was a dry run: nothing was applied for real.
    assert all(r.params.get("dryRun") == "All" for r in writes), [
        (r.method, r.url.path, dict(r.params)) for r in writes
    ]


async def test_second_reconcile_changes_nothing(cluster: Cluster) -> None:
    spec = {
        "replicas": 2,
        "ingress": {"host": "chat.example.com"},
        "apiKeySecretRef": {"name": "k"},
    }
    async with running_operator(cluster):
        await cluster.create(isvc("chat", spec))
        await eventually(lambda: cluster.get(ING, NS, "chat"))
        await mark_ready(cluster, "chat", ranks=2)
        await eventually(lambda: reason(cluster, "chat") == "Ready")
    before = cluster.snapshot()
    start = len(cluster.requests())

    # A restarted operator resumes every InferenceService: it reconciles them all again.
    async with running_operator(cluster):
        await eventually(
            lambda: any(
                r.params.get("fieldManager") == c.FIELD_MANAGER and "dryRun" not in r.params
                for r in cluster.requests(start)
            ),
            what="the second reconcile's apply",
        )
        await eventually(
            lambda: any(
                r.method == "GET" and r.url.path.endswith("/pods") and "watch" not in r.params
                for r in cluster.requests(start)
            ),
            what="the status refresh after the apply",
        )
    after = cluster.snapshot()
    assert after.keys() == before.keys()
    for key, obj in before.items():
        assert after[key] == obj, f"{key} changed on the second reconcile"
    status_writes = [r for r in cluster.requests(start) if r.url.path.endswith("/status")]
    assert status_writes == []


async def test_delete_leaves_nothing_blocking_and_children_to_garbage_collection(
    cluster: Cluster, operator: None, caplog: pytest.LogCaptureFixture
) -> None:
    await cluster.create(isvc("chat", {}))
    await eventually(lambda: cluster.get(STS, NS, "chat"))
    await eventually(lambda: reason(cluster, "chat") == "RanksNotReady")
    # No finalizer: deleting an InferenceService never waits for the operator.
    assert "finalizers" not in cluster.get(ISVC, NS, "chat")["metadata"]
    await cluster.delete(ISVC, NS, "chat")
    assert cluster.get(ISVC, NS, "chat") is None
    # Kubernetes' garbage collector removes the children through their owner references;
    # their deletion events must find the parent gone, quietly.
    start = len(cluster.requests())
    await cluster.delete(STS, NS, "chat")
    await cluster.delete(DEPLOY, NS, "chat-router")
    await eventually(
        lambda: any(
            r.method == "GET" and r.url.path.endswith("/inferenceservices/chat")
            for r in cluster.requests(start)
        ),
        what="the refresh that finds the parent gone",
    )
    assert cluster.get(ISVC, NS, "chat") is None
    # A refresh already under way when the parent went may still try to write (and get a 404,
    # as from a real API server); none of it is an error.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not [r for r in caplog.records if "Could not refresh" in r.getMessage()]


@pytest.mark.parametrize("name", ["a" * 46, "chat.v2"])
async def test_names_that_cannot_name_children_are_invalid(
    cluster: Cluster, operator: None, name: str
) -> None:
    await cluster.create(isvc(name, {}))
    await eventually(lambda: reason(cluster, name) == "InvalidSpec")
    assert "metadata.name" in cluster.condition(NS, name, "Ready")["message"]
    assert cluster.names(STS, NS) == []
