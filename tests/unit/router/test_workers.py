"""The worker registry: the health state machine, active checks (against a fake rank), membership
changes from discovery, load accounting, and the router's choice of rank (pinning, routing keys)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from berth_common import kube as kube_module
from berth_common.errors import RequestError
from berth_common.kube import ApiServer, token_reader
from berth_router.args import RouterArgs
from berth_router.discovery import (
    DiscoveryError,
    EndpointSliceDiscovery,
    KubeConfig,
    endpoints_from_slices,
    parse_selector,
    selector_matches,
)
from berth_router.metrics import RouterMetrics
from berth_router.policies import PREFIX_HIT, CacheAware, RoundRobin, rendezvous_order
from berth_router.proxy import PINNED, ROUTING_KEY, Router
from berth_router.signals import DP_RANK_HEADER, RouteSignals
from berth_router.workers import (
    Endpoint,
    HealthState,
    LoadSnapshot,
    Worker,
    WorkerRegistry,
)

# --- the health state machine ------------------------------------------------------------------


def test_a_new_worker_is_decided_by_its_first_check() -> None:
    good = HealthState(failure_threshold=3, success_threshold=3)
    assert good.status == "unknown" and not good.healthy
    assert good.success() is True and good.healthy
    bad = HealthState(failure_threshold=3, success_threshold=3)
    assert bad.failure("refused") is True and bad.status == "unhealthy"


def test_healthy_needs_consecutive_failures_unless_one_is_definitive() -> None:
    h = HealthState(failure_threshold=3, success_threshold=2)
    h.success()
    assert h.failure("timeout") is False and h.healthy
    assert h.failure("timeout") is False and h.healthy
    h.success()  # the streak is broken
    assert h.failure("timeout") is False and h.failure("timeout") is False
    assert h.failure("timeout") is True and h.status == "unhealthy"
    assert h.reason == "timeout"
    d = HealthState(failure_threshold=3, success_threshold=2)
    d.success()
    assert d.failure("draining", definitive=True) is True and not d.healthy


def test_unhealthy_needs_consecutive_successes_to_come_back() -> None:
    h = HealthState(failure_threshold=1, success_threshold=3)
    h.failure("down")
    assert h.success() is False and h.success() is False
    h.failure("down again")  # the streak is broken
    assert h.failure("still down") is False  # already unhealthy: no change
    assert h.success() is False and h.success() is False
    assert h.success() is True and h.healthy and h.reason == ""


# --- a registry against fake ranks -------------------------------------------------------------


def make_args(**kwargs: Any) -> RouterArgs:
    defaults: dict[str, Any] = {
        "worker_urls": ("http://r0", "http://r1", "http://r2"),
        "health_failure_threshold": 2,
        "health_success_threshold": 2,
    }
    return RouterArgs(**{**defaults, **kwargs})


class FakeRanks:
    """httpx transport playing the ranks: /health, /get_server_info, /get_load per host."""

    def __init__(self) -> None:
        self.health: dict[str, tuple[int, dict[str, Any]]] = {}
        self.rank_of: dict[str, int | None] = {}
        self.down: set[str] = set()
        self.load: dict[str, dict[str, Any]] = {}
        self.while_answering_load: Callable[[], None] = lambda: None
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        host = request.url.host
        if host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            status, body = self.health.get(host, (200, {"status": "ok"}))
            return httpx.Response(status, json=body)
        if request.url.path == "/get_server_info":
            return httpx.Response(200, json={"dp_rank": self.rank_of.get(host, int(host[1:]))})
        if request.url.path == "/get_load":
            answer = httpx.Response(200, json=self.load.get(host, {}))
            self.while_answering_load()  # what the router does before the answer reaches it
            return answer
        return httpx.Response(404)


@pytest.fixture
def fake() -> FakeRanks:
    return FakeRanks()


async def registry_with(fake: FakeRanks, **kwargs: Any) -> WorkerRegistry:
    args = make_args(**kwargs)
    registry = WorkerRegistry(args, RouterMetrics())
    await registry.client.aclose()
    registry.client = httpx.AsyncClient(transport=httpx.MockTransport(fake))
    return registry


async def settle(registry: WorkerRegistry) -> None:
    tasks = [w.check_task for w in registry.workers.values() if w.check_task is not None]
    if tasks:
        await asyncio.wait(tasks)


async def test_static_workers_are_checked_before_traffic_and_rank_claims_verified(
    fake: FakeRanks,
) -> None:
    fake.rank_of["r2"] = 0  # misconfigured: the third URL is another rank 0
    registry = await registry_with(fake)
    registry.set_static(registry.args.worker_urls)
    await registry.initial_checks()
    assert registry.checked.is_set()
    assert [w.rank for w in registry.routable()] == [0, 1]
    assert "says it is rank 0, not 2" in registry.get(2).health.reason
    assert registry.metrics.healthy.labels("2")._value.get() == 0
    assert registry.metrics.healthy.labels("0")._value.get() == 1
    # The rank claim is asked once per process, not on every check.
    await registry.check(registry.get(0))
    infos = [r for r in fake.requests if r.url.path == "/get_server_info" and r.url.host == "r0"]
    assert len(infos) == 1
    await registry.close()


async def test_checks_take_ranks_out_and_bring_them_back(fake: FakeRanks) -> None:
    registry = await registry_with(fake)
    registry.set_static(registry.args.worker_urls)
    await registry.initial_checks()
    r0, r1, r2 = (registry.get(i) for i in range(3))
    # A draining rank is out at the first check; a flaky one only after two.
    fake.health["r0"] = (503, {"status": "draining", "reason": "shutting down"})
    fake.health["r1"] = (500, {"status": "error"})
    await registry.check(r0)
    await registry.check(r1)
    assert not r0.routable and "draining" in r0.health.reason
    assert r1.routable
    await registry.check(r1)
    assert not r1.routable
    # A refused connection seen by a real request: out at once.
    registry.report_connect_failure(r2, "refused")
    assert not r2.routable and registry.routable() == []
    # Recovery takes two good checks in a row.
    fake.health.clear()
    for worker in (r0, r1, r2):
        await registry.check(worker)
    assert registry.routable() == []
    for worker in (r0, r1, r2):
        await registry.check(worker)
    assert [w.rank for w in registry.routable()] == [0, 1, 2]
    # A dead process (nothing listening) is definitive too.
    fake.down.add("r1")
    await registry.check(r1)
    assert not r1.routable and "connection failed" in r1.health.reason
    await registry.close()


async def test_discovery_updates_join_leave_move_and_readiness(fake: FakeRanks) -> None:
    reset: list[int] = []
    registry = WorkerRegistry(
        make_args(worker_urls=()), RouterMetrics(), on_rank_reset=reset.append
    )
    await registry.client.aclose()
    registry.client = httpx.AsyncClient(transport=httpx.MockTransport(fake))
    registry.update({0: Endpoint("http://r0", True), 1: Endpoint("http://r1", True)})
    await settle(registry)
    assert registry.synced.is_set() and [w.rank for w in registry.routable()] == [0, 1]

    # Rank 1's pod is not ready (its readiness probe failed): out of rotation, still a rank.
    registry.update({0: Endpoint("http://r0", True), 1: Endpoint("http://r1", False)})
    assert [w.rank for w in registry.routable()] == [0]
    assert registry.get(1) is not None and "not ready" in registry.get(1).unavailable_reason

    # Rank 1 comes back on a new pod (new address): unchecked until checked, cache forgotten.
    registry.update({0: Endpoint("http://r0", True), 1: Endpoint("http://r9", True)})
    assert registry.get(1).health.status == "unknown" and reset == [1]
    fake.rank_of["r9"] = 1
    await settle(registry)
    assert [w.rank for w in registry.routable()] == [0, 1]

    # A new rank joins; a rank with no endpoint at all is known but unavailable.
    registry.update(
        {0: Endpoint("http://r0", True), 1: Endpoint("http://r9", True), 2: Endpoint(None, False)}
    )
    await settle(registry)
    assert registry.ranks() == [0, 1, 2] and "no endpoint" in registry.get(2).unavailable_reason

    # Scale down: rank 2's Service (and slices) are gone.
    registry.update({0: Endpoint("http://r0", True), 1: Endpoint("http://r9", True)})
    assert registry.ranks() == [0, 1] and reset == [1, 2]
    await registry.close()


def test_load_is_own_in_flight_plus_what_others_sent() -> None:
    worker = Worker(rank=0, url="http://r0", health=HealthState())
    worker.in_flight = 3
    assert worker.load(now=10.0, max_age=2.0) == 3.0
    # The rank had 10 in flight when this router had 2 there: 8 came from elsewhere.
    worker.load_snapshot = LoadSnapshot(10, 6, 4, 0.5, received=9.5, own_requests=2)
    assert worker.load(now=10.0, max_age=2.0) == 3 + 8
    assert worker.load(now=20.0, max_age=2.0) == 3.0  # stale: ignored
    worker.load_snapshot = LoadSnapshot(1, 1, 0, 0.1, received=9.5, own_requests=2)
    assert worker.load(now=10.0, max_age=2.0) == 3.0  # never below our own count


async def test_load_poll_reads_get_load(fake: FakeRanks) -> None:
    fake.load["r0"] = {
        "num_running_reqs": 4,
        "num_waiting_reqs": 2,
        "num_inflight_requests": 7,
        "token_usage": 0.25,
    }
    registry = await registry_with(fake)
    registry.set_static(("http://r0",))
    await registry.initial_checks()
    await registry._poll_load(registry.get(0))
    snap = registry.get(0).load_snapshot
    assert snap is not None and (snap.requests, snap.running, snap.waiting) == (7, 4, 2)
    assert registry.load_of(registry.get(0)) == 7.0
    await registry.close()


async def test_a_request_that_ends_while_the_poll_is_out_is_not_load_from_elsewhere(
    fake: FakeRanks,
) -> None:
    registry = await registry_with(fake)
    registry.set_static(("http://r0",))
    await registry.initial_checks()
    worker = registry.get(0)
    registry.begin(worker)
    # The rank counts this router's request when it answers; the request ends (at the router)
    # before the answer arrives.
    fake.load["r0"] = {"num_running_reqs": 1, "num_inflight_requests": 1}
    fake.while_answering_load = lambda: registry.end(worker)
    await registry._poll_load(worker)
    assert worker.in_flight == 0
    assert registry.load_of(worker) == 0.0  # no phantom request to steer the next one away

    # A request of this router's that ended well before the poll is not subtracted: the rank's
    # one request in flight came from elsewhere.
    fake.while_answering_load = lambda: None
    worker.ended[-1] -= 1.0
    await registry._poll_load(worker)
    assert registry.load_of(worker) == 1.0
    await registry.close()


# --- choosing a rank ---------------------------------------------------------------------------


async def healthy_router(fake: FakeRanks, policy: Any = None) -> Router:
    registry = await registry_with(fake)
    registry.set_static(registry.args.worker_urls)
    await registry.initial_checks()
    return Router(registry.args, registry, policy or RoundRobin(), registry.metrics)


async def test_pinning_valid_unknown_and_down_ranks(fake: FakeRanks) -> None:
    router = await healthy_router(fake)
    worker, decision = router.choose(RouteSignals(pinned_rank=2, pinned_by="x"), set())
    assert (worker.rank, decision) == (2, PINNED)
    with pytest.raises(RequestError) as e:
        router.choose(RouteSignals(pinned_rank=3, pinned_by=DP_RANK_HEADER), set())
    assert e.value.status_code == 400 and e.value.code == "rank_not_found"
    assert e.value.param == DP_RANK_HEADER and "0..2" in e.value.message
    router.registry.report_connect_failure(router.registry.get(1), "refused")
    with pytest.raises(RequestError) as e:
        router.choose(RouteSignals(pinned_rank=1, pinned_by="routed_dp_rank"), set())
    assert e.value.status_code == 503 and e.value.code == "rank_unavailable"
    assert e.value.headers == {"Retry-After": "1"} and "refused" in e.value.message
    # A pinned request is never moved: having tried rank 2 already, it fails.
    with pytest.raises(RequestError) as e:
        router.choose(RouteSignals(pinned_rank=2), {2})
    assert e.value.status_code == 503
    await router.registry.close()
    await router.close()


async def test_routing_keys_stick_and_fail_over_to_their_next_choice(fake: FakeRanks) -> None:
    router = await healthy_router(fake)
    keys = [f"user-{i}" for i in range(30)]
    first = {k: router.choose(RouteSignals(routing_key=k), set())[0].rank for k in keys}
    assert len(set(first.values())) == 3  # keys spread over the ranks
    for _ in range(3):  # and stay where they are
        for k in keys:
            worker, decision = router.choose(RouteSignals(routing_key=k), set())
            assert (worker.rank, decision) == (first[k], ROUTING_KEY)
    router.registry.report_connect_failure(router.registry.get(0), "refused")
    for k in keys:
        rank = router.choose(RouteSignals(routing_key=k), set())[0].rank
        expected = first[k] if first[k] != 0 else rendezvous_order(k, [0, 1, 2])[1]
        assert rank == expected
    await router.registry.close()
    await router.close()


async def test_policy_choice_excludes_tried_and_unhealthy_ranks(fake: FakeRanks) -> None:
    router = await healthy_router(fake, CacheAware())
    text = "a long shared system prompt " * 20
    holder = router.choose(RouteSignals(text=text + "1"), set())[0].rank
    worker, decision = router.choose(RouteSignals(text=text + "2"), set())
    assert (worker.rank, decision) == (holder, PREFIX_HIT)
    # The retry of a failed attempt goes elsewhere.
    worker, _ = router.choose(RouteSignals(text=text + "3"), {holder})
    assert worker.rank != holder
    for rank in range(3):
        router.registry.report_connect_failure(router.registry.get(rank), "refused")
    with pytest.raises(RequestError) as e:
        router.choose(RouteSignals(text=text), set())
    assert e.value.status_code == 503 and e.value.code == "no_available_workers"
    decisions = router.metrics.decisions
    assert decisions.labels("cache_aware", PREFIX_HIT)._value.get() == 1
    await router.registry.close()
    await router.close()


# --- discovery: EndpointSlices -> endpoints ----------------------------------------------------


def endpoint_slice(
    name: str, rank: str | None, endpoints: list[dict[str, Any]], port: int = 8000
) -> dict[str, Any]:
    labels = {"serving.berth.dev/inferenceservice": "chat"}
    if rank is not None:
        labels["serving.berth.dev/dp-rank"] = rank
    return {
        "metadata": {"name": name, "labels": labels},
        "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": port}],
        "endpoints": endpoints,
    }


def ep(address: str, ready: bool | None = True) -> dict[str, Any]:
    conditions = {} if ready is None else {"ready": ready}
    return {"addresses": [address], "conditions": conditions}


def test_endpoints_from_slices_per_rank() -> None:
    slices = {
        "a": endpoint_slice("a", "0", [ep("10.0.0.1")]),
        "b": endpoint_slice("b", "1", [ep("10.0.0.2", ready=False)]),
        "c": endpoint_slice("c", "2", []),  # the Service exists, its pod does not
        "d": endpoint_slice("d", None, [ep("10.0.0.9")]),  # the headless Service: no rank
        "e": endpoint_slice("e", "3", [ep("fd00::5", ready=None)]),  # unknown = ready
        "f": endpoint_slice("f", "4", [ep("10.0.0.7", ready=False), ep("10.0.0.8")]),
        "g": endpoint_slice("g", "x", [ep("10.0.0.6")]),
    }
    assert endpoints_from_slices(slices, "serving.berth.dev/dp-rank", "http") == {
        0: Endpoint("http://10.0.0.1:8000", True),
        1: Endpoint("http://10.0.0.2:8000", False),
        2: Endpoint(None, False),
        3: Endpoint("http://[fd00::5]:8000", True),
        4: Endpoint("http://10.0.0.8:8000", True),
    }


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        ("a=b,c", {"a": "b", "c": "1"}, True),
        ("a=b,c", {"a": "b"}, False),
        ("a==b", {"a": "b"}, True),
        ("a!=b", {"a": "c"}, True),
        ("a!=b", {}, True),
        ("a!=b", {"a": "b"}, False),
        ("!c", {"a": "b"}, True),
        ("!c", {"c": ""}, False),
        ("", {"x": "y"}, True),
    ],
)
def test_label_selectors(selector: str, labels: dict[str, str], matches: bool) -> None:
    assert selector_matches(parse_selector(selector), labels) is matches


# --- discovery: the list + watch loop ----------------------------------------------------------


class Lines(httpx.AsyncByteStream):
    def __init__(self, events: list[dict[str, Any]], then_wait: bool = False) -> None:
        self.events = events
        self.then_wait = then_wait

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self.events:
            yield (json.dumps(event) + "\n").encode()
        if self.then_wait:
            await asyncio.sleep(3600)


def slice_with_version(
    name: str, rank: str, address: str, version: str, ready: bool = True
) -> dict[str, Any]:
    item = endpoint_slice(name, rank, [ep(address, ready)])
    item["metadata"]["resourceVersion"] = version
    return item


async def test_discovery_lists_watches_and_lists_again_when_the_watch_expires(
    tmp_path: Path,
) -> None:
    calls: list[httpx.Request] = []
    lists = [
        [
            slice_with_version("s0", "0", "10.0.0.1", "4"),
            slice_with_version("s1", "1", "10.0.0.2", "4"),
        ],
        [slice_with_version("s0", "0", "10.0.0.1", "9")],  # after the relist: rank 1 is gone
    ]
    watches = [
        [
            {"type": "MODIFIED", "object": slice_with_version("s1", "1", "10.0.0.2", "5", False)},
            {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "7"}}},
            {"type": "ADDED", "object": slice_with_version("s2", "2", "10.0.0.3", "8")},
            {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}},
        ],
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if request.url.params.get("watch") == "true":
            events = watches.pop(0) if watches else []
            return httpx.Response(200, stream=Lines(events, then_wait=not events))
        items = lists.pop(0)
        return httpx.Response(200, json={"metadata": {"resourceVersion": "9"}, "items": items})

    token = tmp_path / "token"
    token.write_text("t1")
    seen: list[dict[int, Endpoint]] = []
    kube = KubeConfig(ApiServer("http://api", token=token_reader(token)), "team-a")
    discovery = EndpointSliceDiscovery(
        kube,
        "serving.berth.dev/inferenceservice=chat,serving.berth.dev/dp-rank",
        "serving.berth.dev/dp-rank",
        "http",
        seen.append,
    )
    await discovery.client.aclose()
    discovery.client = kube.server.client(httpx.Timeout(5.0), httpx.MockTransport(handler))
    task = asyncio.create_task(discovery.run())
    for _ in range(200):
        if len(seen) >= 4:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await discovery.close()
    assert seen == [
        {0: Endpoint("http://10.0.0.1:8000", True), 1: Endpoint("http://10.0.0.2:8000", True)},
        {0: Endpoint("http://10.0.0.1:8000", True), 1: Endpoint("http://10.0.0.2:8000", False)},
        {
            0: Endpoint("http://10.0.0.1:8000", True),
            1: Endpoint("http://10.0.0.2:8000", False),
            2: Endpoint("http://10.0.0.3:8000", True),
        },
        {0: Endpoint("http://10.0.0.1:8000", True)},  # relisted: what the list says, no more
    ]
    first_watch = next(c for c in calls if c.url.params.get("watch") == "true")
    assert first_watch.url.params["resourceVersion"] == "9"
    assert first_watch.url.params["labelSelector"].endswith(",serving.berth.dev/dp-rank")
    assert all(c.headers["authorization"] == "Bearer t1" for c in calls)
    assert [c.url.path for c in calls][
        0
    ] == "/apis/discovery.k8s.io/v1/namespaces/team-a/endpointslices"


def test_in_cluster_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "namespace").write_text("team-b\n")
    (tmp_path / "token").write_text("first")
    monkeypatch.setattr(kube_module, "SERVICE_ACCOUNT_DIR", tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    kube = KubeConfig.from_environment(None, None)
    assert (kube.server.url, kube.namespace) == ("https://10.96.0.1:6443", "team-b")
    assert kube.server.headers()["Authorization"] == "Bearer first"
    (tmp_path / "token").write_text("rotated")  # bound tokens rotate: read for every request
    assert kube.server.headers()["Authorization"] == "Bearer rotated"
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    assert KubeConfig.from_environment(None, "x").server.url == "https://[fd00::1]:6443"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    assert KubeConfig.from_environment(None, "x").server.url == "https://kubernetes.default.svc"
    monkeypatch.setattr(kube_module, "SERVICE_ACCOUNT_DIR", tmp_path / "missing")
    with pytest.raises(DiscoveryError, match="--discover-namespace"):
        KubeConfig.from_environment(None, None)
    with pytest.raises(DiscoveryError, match="--kube-api-url"):
        KubeConfig.from_environment(None, "x")
    proxy = KubeConfig.from_environment("http://127.0.0.1:8001", "x").server
    assert (proxy.token, proxy.ca_path, proxy.headers()) == (
        None,
        None,
        {"Accept": "application/json"},
    )
