"""The InferencePool child: what the builder makes of `routing.inferencePool`, what the worker
applies where the cluster does (and does not) serve the kind, and the condition it reports."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from berth_operator import builders, k8s, status
from berth_operator import constants as c
from berth_operator.builders import network, rank_pods, router
from berth_operator.inference_pool import CREATED, NOT_INSTALLED, InferencePoolLink
from berth_operator.spec import SpecError
from berth_operator.status import Observed

from .factories import parse
from .test_status import conditions, deploy, sts

POOL_SPEC = {
    "replicas": 2,
    "routing": {"inferencePool": {"endpointPicker": {"name": "chat-epp"}}},
}


def test_the_pool_selects_the_rank_pods_on_their_serving_port() -> None:
    isvc = parse(POOL_SPEC)
    pool = network.build_inference_pool(isvc)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert (pool["kind"], pool["metadata"]["name"]) == ("InferencePool", "chat")
    selector = pool["spec"]["selector"]["matchLabels"]
    rank_labels = rank_pods.build_rank_statefulset(isvc)["spec"]["template"]["metadata"]["labels"]
    router_labels = router.build_router_deployment(isvc)["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= rank_labels.items()
    assert not selector.items() <= router_labels.items()
    assert rank_labels[c.LABEL_ENGINE_TYPE] == "sglang"  # how the picker reads the ranks
    (container,) = rank_pods.build_rank_statefulset(isvc)["spec"]["template"]["spec"]["containers"]
    assert pool["spec"]["targetPorts"] == [{"number": container["ports"][0]["containerPort"]}]
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": "chat-epp",
        "port": {"number": 9002},  # the picker's ext-proc port by default
        "failureMode": "FailClose",
    }
    without_picker = network.build_inference_pool(parse({"routing": {"inferencePool": {}}}))
    assert "endpointPickerRef" not in without_picker["spec"]


def test_a_pool_is_a_child_only_when_asked_for() -> None:
    kinds = [child["kind"] for child in builders.build_children(parse(POOL_SPEC))]
    assert kinds.count("InferencePool") == 1
    assert "InferencePool" not in [ch["kind"] for ch in builders.build_children(parse({}))]


@pytest.mark.parametrize(
    "picker",
    [{"name": "Not_A_Service"}, {"port": 9002}, {"name": "epp", "failureMode": "Sometimes"}],
)
def test_a_bad_endpoint_picker_is_refused(picker: dict[str, Any]) -> None:
    with pytest.raises(SpecError):
        parse({"routing": {"inferencePool": {"endpointPicker": picker}}})


class FakeKube:
    """The two calls the link makes: API discovery and a read of the pool."""

    def __init__(self, served: bool, existing: dict[str, Any] | None = None) -> None:
        self.served, self.existing = served, existing
        self.calls: list[str] = []

    async def serves(self, rtype: k8s.ResourceType) -> bool:
        self.calls.append(f"serves {rtype.plural}")
        return self.served

    async def get(self, rtype: k8s.ResourceType, namespace: str, name: str) -> Any:
        self.calls.append(f"get {rtype.plural} {namespace}/{name}")
        return self.existing


def prepare(link: InferencePoolLink, kube: FakeKube, spec: dict[str, Any], now: float = 0.0):
    isvc = parse(spec)
    known: dict[Any, Any] = {}
    built = asyncio.run(link.prepare(kube, isvc, builders.build_children(isvc), known, now))
    return [child["kind"] for child in built], known, link.applied(isvc)


def test_without_the_crd_the_pool_is_left_out_reported_once_and_asked_for_each_minute() -> None:
    link, kube = InferencePoolLink(), FakeKube(served=False)
    kinds, known, notice = prepare(link, kube, POOL_SPEC)
    assert "InferencePool" not in kinds and "Deployment" in kinds  # the router serves
    assert known == {} and kube.calls == ["serves inferencepools"]
    assert link.state == NOT_INSTALLED
    assert notice is not None and notice.type == "Warning"
    assert notice.reason == "InferencePoolUnavailable" and "not serve" in notice.message
    _, _, again = prepare(link, kube, POOL_SPEC)
    assert again is None  # said once, not at every apply
    isvc = parse(POOL_SPEC)
    assert not link.recheck_due(isvc, 30.0) and link.recheck_due(isvc, 61.0)
    assert not link.recheck_due(parse({}), 61.0)  # nothing asked for: nothing to look for
    kube.served = True
    assert asyncio.run(link.check(kube, 61.0))


def test_with_the_crd_the_pool_is_applied_and_an_existing_one_is_known() -> None:
    mine = {"kind": "InferencePool", "metadata": {"name": "chat", "uid": "u1"}}
    link, kube = InferencePoolLink(), FakeKube(served=True, existing=mine)
    kinds, known, notice = prepare(link, kube, POOL_SPEC)
    assert "InferencePool" in kinds and known == {("InferencePool", "chat"): mine}
    assert link.state == CREATED and notice is not None and notice.reason == "InferencePoolCreated"
    # No longer asked for: still read (so that the apply prunes it), then never again.
    kinds, known, notice = prepare(link, kube, {"replicas": 2})
    assert "InferencePool" not in kinds and ("InferencePool", "chat") in known
    assert link.state is None and notice is None
    kube.calls.clear()
    prepare(link, kube, {"replicas": 2})
    assert kube.calls == []  # a service without a pool costs no request


def test_the_condition_follows_the_pool() -> None:
    observed = Observed(statefulset=sts(replicas=2, ready=2), router=deploy(replicas=1, ready=1))
    isvc = parse(POOL_SPEC)
    absent = status.compute(isvc, observed, None, generation=1, now="t", inference_pool=None)
    assert "InferencePoolReady" not in conditions(absent)
    missing = status.compute(
        isvc, observed, None, generation=1, now="t", inference_pool=NOT_INSTALLED
    )
    cond = conditions(missing)["InferencePoolReady"]
    assert (cond["status"], cond["reason"]) == ("False", "CRDNotInstalled")
    assert conditions(missing)["Ready"]["status"] == "True"  # served by the router meanwhile
    created = status.compute(isvc, observed, missing, generation=1, now="t", inference_pool=CREATED)
    assert conditions(created)["InferencePoolReady"]["status"] == "True"
    gone = status.compute(isvc, observed, created, generation=1, now="t", inference_pool=None)
    assert "InferencePoolReady" not in conditions(gone)
