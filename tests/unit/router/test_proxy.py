"""The router app in-process against fake ranks (httpx MockTransport): retries before the first
byte, no retries for pinned requests, pass-through of the last 503, a stream that breaks after it
started, header hygiene, the API key, fan-out endpoints, and the OpenAI error bodies."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from berth_router.args import RouterArgs
from berth_router.policies import rendezvous_order
from berth_router.proxy import Router
from berth_router.server import create_app
from tests.helpers import metric


class BrokenStream(httpx.AsyncByteStream):
    """Some SSE events, then the rank dies."""

    def __init__(self, events: list[bytes]) -> None:
        self.events = events

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self.events:
            yield event
        raise httpx.ReadError("connection reset by peer")


class Body(httpx.AsyncByteStream):
    """A body that arrives over the wire, as real responses do (not pre-read like `json=`)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.data


def respond(status: int, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    data = json.dumps(body).encode()
    all_headers = {"Content-Type": "application/json", "Content-Length": str(len(data))}
    return httpx.Response(status, headers={**all_headers, **(headers or {})}, stream=Body(data))


@dataclass
class Ranks:
    """Fake ranks r0..rN: healthy, each answering generation requests as `behaviour` says."""

    behaviour: dict[int, str] = field(default_factory=dict)  # rank -> ok|refuse|drop|503|broken
    seen: list[httpx.Request] = field(default_factory=list)  # all but health / load / info
    checks: list[httpx.Request] = field(default_factory=list)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        rank = int(request.url.host[1:])
        self.checks.append(request)
        path = request.url.path
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if path == "/get_server_info":
            return httpx.Response(200, json={"dp_rank": rank})
        if path == "/get_load":
            return httpx.Response(200, json={"num_inflight_requests": 0})
        self.seen.append(request)
        if path == "/flush_cache":
            return respond(200, {"success": True, "message": ""})
        if path == "/abort_request":
            found = json.loads(request.content)["rid"] == f"rid-on-{rank}"
            return respond(200 if found else 404, {"success": found})
        how = self.behaviour.get(rank, "ok")
        if how == "refuse":
            raise httpx.ConnectError("connection refused", request=request)
        if how == "drop":
            raise httpx.RemoteProtocolError("server disconnected", request=request)
        if how == "503":
            return respond(
                503,
                {"error": {"message": f"rank {rank} is full", "type": "ServiceUnavailableError"}},
                {"Retry-After": "1", "X-Data-Parallel-Rank": str(rank)},
            )
        if how == "broken":
            return httpx.Response(
                200,
                headers={"Content-Type": "text/event-stream"},
                stream=BrokenStream([b'data: {"text": "a"}\n\n', b'data: {"text": "b"}\n\n']),
            )
        return respond(
            200,
            {"rank": rank, "body": json.loads(request.content or b"null")},
            {"X-Data-Parallel-Rank": str(rank), "Server": "rank", "Connection": "close"},
        )


@pytest.fixture
def ranks() -> Ranks:
    return Ranks()


def fastapi_app(asgi: Any) -> Any:
    """The FastAPI app inside the router's middlewares."""
    while not hasattr(asgi, "state"):
        asgi = asgi.app
    return asgi


async def start(ranks: Ranks, n: int = 3, **kwargs: Any) -> tuple[httpx.AsyncClient, Router]:
    args = RouterArgs(
        worker_urls=tuple(f"http://r{i}" for i in range(n)),
        policy=kwargs.pop("policy", "round_robin"),
        **kwargs,
    )
    app = create_app(args)
    router: Router = fastapi_app(app).state.router
    transport = httpx.MockTransport(ranks)
    await router.client.aclose()
    router.client = httpx.AsyncClient(transport=transport)
    registry = router.registry
    headers = registry.client.headers  # what the registry sends its ranks (the API key)
    await registry.client.aclose()
    registry.client = httpx.AsyncClient(transport=transport, headers=headers)
    router.registry.set_static(args.worker_urls)
    await router.registry.initial_checks()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")
    return client, router


def pinned(rank: int) -> dict[str, str]:
    return {"X-Data-Parallel-Rank": str(rank)}


async def test_a_refused_connection_is_retried_on_another_rank_and_taken_out(
    ranks: Ranks,
) -> None:
    client, router = await start(ranks)
    ranks.behaviour[0] = "refuse"
    key = next(k for k in map(str, range(100)) if rendezvous_order(k, range(3))[0] == 0)
    r = await client.post("/v1/completions", json={"prompt": "hi", "routing_key": key})
    assert r.status_code == 200
    assert r.json()["rank"] == rendezvous_order(key, range(3))[1]  # the key's second choice
    assert r.headers["x-data-parallel-rank"] == str(r.json()["rank"])
    assert [q.url.host for q in ranks.seen][0] == "r0"
    # Out of rotation as soon as it refused once: nothing more goes there.
    assert not router.registry.get(0).routable
    samples = scrape_app(router)
    assert metric(samples, "berth:router_retries_total") == 1
    assert metric(samples, "berth:router_upstream_errors_total", dp_rank="0", reason="connect") == 1
    for _ in range(6):
        r = await client.post("/v1/completions", json={"prompt": "again"})
        assert r.status_code == 200 and r.json()["rank"] in (1, 2)
    assert sum(q.url.host == "r0" for q in ranks.seen) == 1


async def test_a_dropped_connection_before_the_answer_is_retried(ranks: Ranks) -> None:
    client, router = await start(ranks)
    ranks.behaviour[0] = "drop"
    answered = {
        (await client.post("/v1/completions", json={"p": i})).json()["rank"] for i in range(6)
    }
    assert answered == {1, 2}
    assert (
        metric(scrape_app(router), "berth:router_upstream_errors_total", reason="disconnect") >= 1
    )


async def test_when_every_rank_is_full_the_last_503_reaches_the_client(ranks: Ranks) -> None:
    client, router = await start(ranks, max_retries=5)
    ranks.behaviour.update({0: "503", 1: "503", 2: "503"})
    r = await client.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 503
    assert r.json()["error"]["message"].endswith("is full") and r.headers["retry-after"] == "1"
    assert len(ranks.seen) == 3  # each rank once, then there is nobody left to try
    assert metric(scrape_app(router), "berth:router_retries_total") == 2
    # 503 is not ill health: the ranks stay in rotation.
    assert len(router.registry.routable()) == 3


async def test_retries_are_bounded(ranks: Ranks) -> None:
    client, _ = await start(ranks, max_retries=0)
    ranks.behaviour.update({0: "refuse", 1: "refuse", 2: "refuse"})
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_available_workers"
    assert len(ranks.seen) == 1
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


async def test_a_pinned_request_is_never_moved(ranks: Ranks) -> None:
    client, _ = await start(ranks)
    ranks.behaviour[1] = "refuse"
    r = await client.post("/v1/completions", json={"prompt": "x"}, headers=pinned(1))
    assert r.status_code == 503
    assert (
        r.json()["error"]["code"] == "rank_unavailable"
        and r.json()["error"]["param"] == "X-Data-Parallel-Rank"
    )
    assert [q.url.host for q in ranks.seen] == ["r1"]
    # Pinned to a full rank, the rank's own 503 comes back.
    ranks.behaviour[2] = "503"
    r = await client.post("/v1/completions", json={"prompt": "x", "routed_dp_rank": 2})
    assert r.status_code == 503 and r.json()["error"]["message"] == "rank 2 is full"


async def test_a_stream_that_breaks_after_it_started_ends_with_an_error_event(
    ranks: Ranks,
) -> None:
    client, router = await start(ranks)
    ranks.behaviour[0] = "broken"
    r = await client.post(
        "/v1/completions", json={"prompt": "x", "stream": True}, headers=pinned(0)
    )
    assert r.status_code == 200
    events = [line for line in r.text.split("\n") if line.startswith("data: ")]
    assert events[:2] == ['data: {"text": "a"}', 'data: {"text": "b"}']
    error = json.loads(events[2].removeprefix("data: "))["error"]
    assert error["type"] == "InternalServerError" and "failed while streaming" in error["message"]
    assert events[3] == "data: [DONE]"
    samples = scrape_app(router)
    assert metric(samples, "berth:router_upstream_errors_total", reason="stream_broken") == 1


async def test_headers_and_body_pass_through_and_the_rank_is_named(ranks: Ranks) -> None:
    client, _ = await start(ranks)
    body = b'{"prompt": "exact bytes",   "max_tokens": 1}'
    r = await client.post(
        "/v1/completions?x=1",
        content=body,
        headers={
            "Content-Type": "application/json",
            "X-Routing-Key": "user-1",
            "Connection": "keep-alive",
            "Authorization": "Bearer client-key",
        },
    )
    assert r.status_code == 200
    (upstream,) = ranks.seen
    assert upstream.content == body and upstream.url.query == b"x=1"
    assert upstream.headers["x-routing-key"] == "user-1"
    assert upstream.headers["authorization"] == "Bearer client-key"
    assert r.headers["x-berth-route"] == "routing_key"
    assert r.headers.get_list("x-data-parallel-rank") == [str(r.json()["rank"])]
    # The rank's hop-by-hop and server headers stay between the router and the rank.
    assert "connection" not in r.headers and "server" not in r.headers


async def test_bad_pins_and_unknown_routes_are_openai_errors(ranks: Ranks) -> None:
    client, _ = await start(ranks)
    for response in (
        await client.post("/v1/completions", json={"prompt": "x"}, headers=pinned(9)),
        await client.post("/v1/completions", json={"routed_dp_rank": -2}),
        await client.post("/generate", json={"text": "x"}, headers={"X-Data-Parallel-Rank": "a"}),
        await client.get("/v2/nothing"),
    ):
        assert response.status_code in (400, 404)
        assert set(response.json()) == {"error"}
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert ranks.seen == []


async def test_hostile_bodies_are_refused_before_any_rank_sees_them(ranks: Ranks) -> None:
    client, _ = await start(ranks, max_request_body_mb=1)
    json_type = {"content-type": "application/json"}
    for content, status in (
        (b"[" * 100_000 + b"]" * 100_000, 400),
        (b'{"prompt": "\\ud800"}', 400),
        (b'{"prompt": "x", "priority": 123456789012345678901234567890}', 400),
        (b'{"prompt": "' + b"x" * 2**20 + b'"}', 413),
    ):
        r = await client.post("/v1/completions", content=content, headers=json_type)
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert ranks.seen == []


async def test_api_key_guards_everything_but_probes_and_metrics(ranks: Ranks) -> None:
    client, _ = await start(ranks, api_key="s3cret")
    r = await client.get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    for path in ("/health", "/liveness", "/readiness", "/metrics"):
        assert (await client.get(path)).status_code == 200, path
    ok = await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    # The router's own calls to the ranks carry the key too (a rank guards /get_server_info).
    infos = [q for q in ranks.checks if q.url.path == "/get_server_info"]
    assert infos and all(q.headers["authorization"] == "Bearer s3cret" for q in infos)


async def test_whole_server_routes_need_the_admin_key(ranks: Ranks) -> None:
    client, _ = await start(ranks, api_key="serve", admin_api_key="adm1n")
    user = {"Authorization": "Bearer serve"}
    admin = {"Authorization": "Bearer adm1n"}
    for path, body in (("/flush_cache", None), ("/abort_request", {"abort_all": True})):
        refused = await client.post(path, json=body, headers=user)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["type"] == "PermissionDeniedError"
    assert not [q for q in ranks.seen if q.url.path in ("/flush_cache", "/abort_request")]
    flushed = await client.post("/flush_cache", headers=admin)
    assert flushed.status_code == 200, flushed.text
    sent = [q for q in ranks.seen if q.url.path == "/flush_cache"]
    assert len(sent) == 3 and all(q.headers["authorization"] == "Bearer adm1n" for q in sent)
    by_id = await client.post("/abort_request", json={"rid": "rid-on-2"}, headers=user)
    assert by_id.status_code == 200  # one request by its id: the serving key's right

    # A serving key and no admin key: nobody may flush or abort everything.
    closed, _ = await start(ranks, api_key="serve")
    refused = await closed.post("/flush_cache", headers=user)
    assert refused.status_code == 403 and "--admin-api-key" in refused.json()["error"]["message"]


async def test_a_path_is_forwarded_as_sent(ranks: Ranks) -> None:
    client, _ = await start(ranks)
    # Decoded, %1C is a control character: no valid URL to send on (a 500 before).
    r = await client.get("/v1/models/a%1Cb")
    assert r.status_code == 200, r.text
    assert ranks.seen[-1].url.raw_path == b"/v1/models/a%1Cb"


async def test_readiness_waits_for_the_worker_list(ranks: Ranks) -> None:
    app = create_app(RouterArgs(worker_urls=("http://r0",)))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")
    r = await client.get("/readiness")
    assert r.status_code == 503 and r.json()["reason"] == "discovering ranks"
    health = await client.get("/health")
    assert health.status_code == 503 and health.json()["reason"] == "no rank is known yet"
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_available_workers"


async def test_flush_and_abort_fan_out_to_every_rank(ranks: Ranks) -> None:
    client, router = await start(ranks, policy="cache_aware")
    await client.post("/v1/completions", json={"prompt": "a long shared prefix " * 10})
    assert router.policy.tree.ranks()  # type: ignore[attr-defined]
    r = await client.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True
    assert sorted(r.json()["ranks"]) == ["0", "1", "2"]
    assert router.policy.tree.ranks() == set()  # type: ignore[attr-defined]
    found = await client.post("/abort_request", json={"rid": "rid-on-2"})
    assert found.status_code == 200 and found.json() == {"success": True}
    missing = await client.post("/abort_request", json={"rid": "nowhere"})
    assert missing.status_code == 404


def scrape_app(router: Router) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(router.metrics.render().decode())
        for s in family.samples
    }
