"""`berth router` over three real `berth serve --dp-rank i` ranks on loopback.

Pinning, routing keys, prefix-cache-aware placement (with the ranks' cached-token counts),
streaming pass-through, disconnect -> abort, retries, metrics, in-cluster discovery from
EndpointSlices (against kmock's emulated API server), and a rank killed under load (last: it
takes a rank of the module's fixture down for good).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import kmock
import openai
import pytest

from berth_common.response_ids import rank_of_response
from berth_router.policies import rendezvous_order
from tests.helpers import RunningServer, metric, scrape, wait_for

from .conftest import RANKS, RunningRouter

TIMEOUT = 120
PREFIX = (
    "You are the dispatcher of a container terminal. Every answer names the berth, the crane "
    "and the shift. The terminal has twelve berths along the north quay and eight along the "
    "south quay; cranes are numbered by quay. Reefer containers need power within an hour. "
) * 5


def complete(
    base_url: str,
    model: str,
    prompt: str,
    *,
    max_tokens: int = 2,
    headers: dict[str, str] | None = None,
    **fields: Any,
) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}
    return httpx.post(
        f"{base_url}/v1/completions", json=body, headers=headers or {}, timeout=TIMEOUT
    )


def served_by(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.headers["x-data-parallel-rank"])


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert set(response.json()) == {"error"}, response.json()
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    if code is not None:
        assert body["code"] == code
    return body


# --- the router's own endpoints ----------------------------------------------------------------


def test_health_readiness_workers_and_models(
    router: RunningRouter, ranks: list[RunningServer], model: str
) -> None:
    health = httpx.get(f"{router.base_url}/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "healthy_ranks": [0, 1, 2], "ranks": [0, 1, 2]}
    assert httpx.get(f"{router.base_url}/liveness").status_code == 200
    assert httpx.get(f"{router.base_url}/readiness").status_code == 200
    workers = router.workers()
    assert [workers[i]["url"] for i in range(3)] == [r.base_url for r in ranks]
    assert all(w["routable"] and w["health"] == "healthy" for w in workers.values())
    models = httpx.get(f"{router.base_url}/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == model
    assert httpx.get(f"{router.base_url}/v1/models/{model}").json()["id"] == model
    assert_openai_error(httpx.get(f"{router.base_url}/no/such/route"), 404)
    # Errors of the ranks come through unchanged (here: an unknown model).
    assert_openai_error(complete(router.base_url, "nope", "hi"), 404, "model_not_found")


# --- pinning -----------------------------------------------------------------------------------


def test_pinning_by_header_and_by_body_field(router: RunningRouter, model: str) -> None:
    for rank in range(3):
        by_header = complete(
            router.base_url, model, f"Pin {rank}", headers={"X-Data-Parallel-Rank": str(rank)}
        )
        assert served_by(by_header) == rank
        assert by_header.headers["x-berth-route"] == "pinned"
        by_body = complete(router.base_url, model, f"Pin {rank}", routed_dp_rank=rank)
        assert served_by(by_body) == rank
        native = httpx.post(
            f"{router.base_url}/generate",
            json={
                "text": "The capital of France is",
                "sampling_params": {"max_new_tokens": 2, "temperature": 0},
                "routed_dp_rank": rank,
            },
            timeout=TIMEOUT,
        )
        assert served_by(native) == rank and native.json()["meta_info"]["completion_tokens"] == 2
    # The body wins over the header, as on a rank.
    both = complete(
        router.base_url, model, "Pin", routed_dp_rank=1, headers={"X-Data-Parallel-Rank": "2"}
    )
    assert served_by(both) == 1


def test_one_request_id_through_the_router_and_the_rank(
    router: RunningRouter, ranks: list[RunningServer], model: str
) -> None:
    response = complete(router.base_url, model, "x", headers={"X-Request-Id": "trace-7"})
    assert response.headers.get_list("x-request-id") == ["trace-7"]
    logged(ranks[served_by(response)], "request_id=trace-7")
    fresh = complete(router.base_url, model, "x")
    assert len(fresh.headers.get_list("x-request-id")) == 1
    logged(ranks[served_by(fresh)], f"request_id={fresh.headers['x-request-id']}")


def logged(rank: RunningServer, text: str) -> None:
    """The rank's log shows `text`: its access line is written just after the response is sent,
    so it may come a moment after the client has the answer."""
    wait_for(lambda: text in rank.output(), 10, what=f"{text} in the rank's log")


def test_stored_responses_are_continued_and_read_on_the_rank_that_holds_them(
    router: RunningRouter, model: str
) -> None:
    """Each rank keeps its own responses; the id names the rank, and the router goes there."""
    client = openai.OpenAI(base_url=f"{router.base_url}/v1", api_key="x", max_retries=0)
    # Made on every rank (pinned: where load alone would place them is not the point here).
    firsts = [
        client.responses.create(
            model=model,
            input=f"Remember the number {n}.",
            max_output_tokens=8,
            temperature=0,
            extra_body={"routed_dp_rank": n % RANKS},
        )
        for n in range(2 * RANKS)
    ]
    assert [rank_of_response(r.id) for r in firsts] == [n % RANKS for n in range(2 * RANKS)]
    for first in firsts:
        raw = client.responses.with_raw_response.create(
            model=model,
            previous_response_id=first.id,
            input="And again?",
            max_output_tokens=8,
            temperature=0,
        )
        assert raw.headers["x-data-parallel-rank"] == str(rank_of_response(first.id))
        second = raw.parse()
        assert second.status in ("completed", "incomplete")
        assert rank_of_response(second.id) == rank_of_response(first.id)
        assert second.usage.input_tokens > first.usage.input_tokens  # it holds the first turn
        assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(firsts[0].id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(firsts[0].id)
    missing = f"resp_r{RANKS + 3}_{'0' * 32}"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=model, previous_response_id=missing, input="x")
    assert info.value.param == "previous_response_id"


def test_one_request_at_a_time_takes_turns_over_the_idle_ranks(
    router: RunningRouter, model: str
) -> None:
    """Short distinct prompts share no prefix worth following: on idle ranks they take turns.
    (Each rank's /get_load once showed a request that had just ended as still running, and the
    next requests avoided that rank: six in a row could land on one.)"""
    ranks = [served_by(complete(router.base_url, model, f"Tell me {n}.")) for n in range(3 * RANKS)]
    assert Counter(ranks) == dict.fromkeys(range(RANKS), 3), ranks


def test_structured_output_and_tool_calls_pass_through_unchanged(
    router: RunningRouter, model: str
) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{router.base_url}/v1", api_key="x", max_retries=0)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "year": {"type": "integer"}},
        "required": ["city", "year"],
        "additionalProperties": False,
    }
    answer = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Where and when?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
        max_tokens=60,
        temperature=0,
    )
    assert set(json.loads(answer.choices[0].message.content or "")) == {"city", "year"}
    tool = {
        "type": "function",
        "function": {"name": "lookup", "parameters": schema},
    }
    called = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Look it up."}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        max_tokens=60,
        temperature=0,
    )
    (call,) = called.choices[0].message.tool_calls or []
    assert call.function.name == "lookup" and set(json.loads(call.function.arguments)) == {
        "city",
        "year",
    }
    bad = httpx.post(
        f"{router.base_url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "x"}], "regex": "a(b"},
        timeout=TIMEOUT,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "regex"


def test_pinning_a_rank_that_does_not_exist_is_400(router: RunningRouter, model: str) -> None:
    body = assert_openai_error(
        complete(router.base_url, model, "x", headers={"X-Data-Parallel-Rank": "3"}),
        400,
        "rank_not_found",
    )
    assert body["param"] == "X-Data-Parallel-Rank" and "0..2" in body["message"]
    body = assert_openai_error(complete(router.base_url, model, "x", routed_dp_rank=7), 400)
    assert body["param"] == "routed_dp_rank"
    assert_openai_error(
        complete(router.base_url, model, "x", headers={"X-Data-Parallel-Rank": "-1"}), 400
    )
    assert_openai_error(complete(router.base_url, model, "x", routed_dp_rank="one"), 400)


def test_pinning_a_rank_that_is_down_is_503_and_others_never_get_there(
    mixed_router: RunningRouter, model: str
) -> None:
    workers = mixed_router.workers()
    assert sorted(workers) == [0, 1, 2, 3, 4]
    assert not workers[4]["routable"] and "connection failed" in workers[4]["reason"]
    body = assert_openai_error(
        complete(mixed_router.base_url, model, "x", headers={"X-Data-Parallel-Rank": "4"}),
        503,
        "rank_unavailable",
    )
    assert "connection failed" in body["message"]
    health = httpx.get(f"{mixed_router.base_url}/health").json()
    assert health["healthy_ranks"] == [0, 1, 2, 3] and health["ranks"] == [0, 1, 2, 3, 4]
    # round_robin over the routable ranks only; rank 3 refuses (503) and is retried elsewhere.
    served = [served_by(complete(mixed_router.base_url, model, f"n{i}")) for i in range(8)]
    assert set(served) == {0, 1, 2}


def test_a_503_before_the_first_byte_is_retried_on_another_rank(
    mixed_router: RunningRouter, model: str
) -> None:
    before = scrape(mixed_router.base_url)
    # A routing key whose first choice is the rank that answers 503.
    key = next(k for k in (f"k{i}" for i in range(1000)) if rendezvous_order(k, range(5))[0] == 3)
    response = complete(mixed_router.base_url, model, "Retry me", headers={"X-Routing-Key": key})
    assert served_by(response) == rendezvous_order(key, [0, 1, 2])[0]
    after = scrape(mixed_router.base_url)
    assert metric(after, "berth:router_retries_total") == (
        metric(before, "berth:router_retries_total") + 1
    )
    errors = "berth:router_upstream_errors_total"
    assert metric(after, errors, dp_rank="3", reason="status_503") == (
        metric(before, errors, dp_rank="3", reason="status_503") + 1
    )
    # Pinned to that rank, the rank's own 503 reaches the client as it was (no retry).
    pinned = complete(mixed_router.base_url, model, "x", headers={"X-Data-Parallel-Rank": "3"})
    assert_openai_error(pinned, 503)
    assert pinned.json()["error"]["message"] == "the queue is full"
    assert pinned.headers["retry-after"] == "1" and pinned.headers["x-data-parallel-rank"] == "3"


# --- routing keys and the prefix cache ---------------------------------------------------------


def test_routing_keys_are_sticky(router: RunningRouter, model: str) -> None:
    keys = [f"session-{i}" for i in range(8)]
    first = {}
    for key in keys:
        first[key] = served_by(
            complete(router.base_url, model, f"Hello {key}", headers={"X-Routing-Key": key})
        )
    assert len(set(first.values())) >= 2  # keys spread over the ranks
    for key in keys:
        by_header = complete(router.base_url, model, "Again", headers={"X-Routing-Key": key})
        by_field = complete(router.base_url, model, "And again", routing_key=key)
        assert served_by(by_header) == served_by(by_field) == first[key]
        assert by_field.headers["x-berth-route"] == "routing_key"


def test_shared_prefix_lands_on_one_rank_and_is_served_from_its_cache(
    router: RunningRouter, ranks: list[RunningServer], model: str
) -> None:
    before = [scrape(r.base_url) for r in ranks]
    responses = [
        complete(router.base_url, model, PREFIX + f"Question {i}: where does ship {i} dock?")
        for i in range(5)
    ]
    served = {served_by(r) for r in responses}
    assert len(served) == 1, f"shared-prefix requests went to ranks {served}"
    (rank,) = served
    assert [r.headers["x-berth-route"] for r in responses[1:]] == ["prefix_hit"] * 4
    prompt_tokens = responses[0].json()["usage"]["prompt_tokens"]
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses]
    # Every request after the first reuses the shared prefix from that rank's radix cache.
    assert all(c >= prompt_tokens * 0.8 for c in cached[1:]), (prompt_tokens, cached)
    after = scrape(ranks[rank].base_url)
    gained = metric(after, "sglang:cached_tokens_total") - metric(
        before[rank], "sglang:cached_tokens_total"
    )
    assert gained >= sum(cached[1:])

    # Unrelated prompts are not glued to that rank: they spread over the ranks.
    unrelated = [
        complete(router.base_url, model, f"{word} is a word about something else entirely.")
        for word in ("Anchor", "Bollard", "Capstan", "Derrick", "Ensign", "Fender")
    ]
    spread = Counter(served_by(r) for r in unrelated)
    assert len(spread) >= 2, spread
    assert {r.headers["x-berth-route"] for r in unrelated} == {"load_fallback_miss"}


# --- streaming and disconnects -----------------------------------------------------------------


def test_streaming_passes_through_chunk_by_chunk(
    router: RunningRouter, ranks: list[RunningServer], model: str
) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Name three harbours."}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    arrivals: list[tuple[float, bytes]] = []
    with httpx.stream(
        "POST", f"{router.base_url}/v1/chat/completions", json=body, timeout=TIMEOUT
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        rank = int(response.headers["x-data-parallel-rank"])
        for chunk in response.iter_raw():
            arrivals.append((time.monotonic(), chunk))
    raw = b"".join(c for _, c in arrivals).decode()
    events = [line[len("data: ") :] for line in raw.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    # Not buffered: the events arrived in many separate reads, spread over the generation.
    assert len(arrivals) >= 4, [len(c) for _, c in arrivals]
    assert arrivals[-1][0] - arrivals[0][0] > 0.02
    # Byte for byte what the rank streams (greedy), apart from ids and timestamps.
    direct = openai.OpenAI(base_url=f"{ranks[rank].base_url}/v1", api_key="x", max_retries=0)
    want = direct.chat.completions.create(**{**body, "stream": False, "stream_options": None})
    assert text == want.choices[0].message.content
    # The OpenAI SDK streams through the router unchanged.
    client = openai.OpenAI(base_url=f"{router.base_url}/v1", api_key="x", max_retries=0)
    sdk_text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**{**body, "stream_options": None})
        if c.choices
    )
    assert sdk_text == text


def aborted(rank: RunningServer) -> float:
    return metric(scrape(rank.base_url), "sglang:num_aborted_requests_total")


def idle(rank: RunningServer) -> bool:
    return httpx.get(f"{rank.base_url}/get_load", timeout=5).json()["num_inflight_requests"] == 0


def test_client_disconnect_aborts_the_upstream_request(
    router: RunningRouter, ranks: list[RunningServer], model: str
) -> None:
    rank = ranks[0]
    long_request = {
        "model": model,
        "prompt": "Count the ships:",
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0,
        "routed_dp_rank": 0,
    }
    start = aborted(rank)
    with httpx.stream(
        "POST",
        f"{router.base_url}/v1/completions",
        json={**long_request, "stream": True},
        timeout=TIMEOUT,
    ) as response:
        assert response.status_code == 200
        for i, _ in enumerate(response.iter_raw()):
            if i == 2:
                break  # the client leaves mid-stream
    wait_for(lambda: aborted(rank) >= start + 1, 15, what="the streamed request to be aborted")
    wait_for(lambda: idle(rank), 15, what="rank 0 to be idle")

    # Not streaming: the client gives up while the rank is still generating.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{router.base_url}/v1/completions", json=long_request, timeout=1.5)
    wait_for(lambda: aborted(rank) >= start + 2, 15, what="the waiting request to be aborted")
    wait_for(lambda: idle(rank), 15, what="rank 0 to be idle")
    assert metric(scrape(router.base_url), "berth:router_client_disconnects_total") >= 2


def test_router_metrics_count_requests_decisions_and_errors(router: RunningRouter) -> None:
    samples = scrape(router.base_url)
    requests = "berth:router_requests_total"
    for rank in ("0", "1", "2"):
        assert metric(samples, requests, dp_rank=rank, status_code="200") > 0
    assert metric(samples, requests, dp_rank="none", status_code="400") >= 3  # bad pins
    decisions = "berth:router_policy_decisions_total"
    for decision in ("prefix_hit", "load_fallback_miss", "pinned", "routing_key"):
        assert metric(samples, decisions, policy="cache_aware", decision=decision) > 0, decision
    for rank in ("0", "1", "2"):
        assert metric(samples, "berth:router_worker_healthy", dp_rank=rank) == 1
        assert metric(samples, "berth:router_in_flight_requests", dp_rank=rank) == 0
    assert metric(samples, "berth:router_request_duration_seconds_count") > 0


# --- discovery ---------------------------------------------------------------------------------

ISVC = "serving.berth.dev/inferenceservice"
RANK_LABEL = "serving.berth.dev/dp-rank"
SLICES = "/apis/discovery.k8s.io/v1/namespaces/team-a/endpointslices"


def endpoint_slice(name: str, rank: int | None, url: str, ready: bool = True) -> dict[str, Any]:
    host, port = url.removeprefix("http://").split(":")
    labels = {ISVC: "chat", "kubernetes.io/service-name": name}
    if rank is not None:
        labels[RANK_LABEL] = str(rank)
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "team-a", "labels": labels},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": int(port), "protocol": "TCP"}],
        "endpoints": [{"addresses": [host], "conditions": {"ready": ready}}],
    }


async def eventually(check: Any, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(check):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


async def test_discovery_follows_endpoint_slices_without_a_restart(
    kmock: kmock.KubernetesEmulator, ranks: list[RunningServer], model: str
) -> None:
    kmock.resources["discovery.k8s.io/v1/endpointslices"] = kmock.ResourceInfo(
        kind="EndpointSlice",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
    )

    async def send(method: str, path: str, body: Any = None) -> None:
        async with kmock.request(method, path, json=body) as response:
            assert response.status < 300, await response.text()

    await send("POST", SLICES, endpoint_slice("chat-rank-0-abc", 0, ranks[0].base_url))
    await send("POST", SLICES, endpoint_slice("chat-rank-1-abc", 1, ranks[1].base_url))
    # Not a rank: a slice without the rank label (the headless Service's). Which slices the
    # selector picks is the API server's business (the emulator ignores labelSelector):
    # tests/cluster/test_operator.py shows the router discovering ranks on a real one.
    await send("POST", SLICES, endpoint_slice("chat-ranks-abc", None, ranks[2].base_url))

    router = RunningRouter(
        "--discover-selector",
        f"{ISVC}=chat,{RANK_LABEL}",
        "--discover-namespace",
        "team-a",
        "--kube-api-url",
        str(kmock.url).rstrip("/"),
        "--health-check-interval",
        "0.5",
    )
    try:
        await eventually(lambda: _ready(router), "the discovering router to be ready", 30)
        workers = await asyncio.to_thread(router.workers)
        assert {r: w["url"] for r, w in workers.items()} == {
            0: ranks[0].base_url,
            1: ranks[1].base_url,
        }

        def pinned(rank: int) -> int:
            return complete(
                router.base_url, model, "x", headers={"X-Data-Parallel-Rank": str(rank)}
            ).status_code

        assert await asyncio.to_thread(pinned, 2) == 400

        # Scale up: a new rank Service appears; the router picks it up, no restart.
        await send("POST", SLICES, endpoint_slice("chat-rank-2-abc", 2, ranks[2].base_url))
        await eventually(lambda: pinned(2) == 200, "rank 2 to join")
        # Rank 1's pod turns unready: it leaves rotation (pinned: 503), the rest keep serving.
        await send(
            "PATCH",
            f"{SLICES}/chat-rank-1-abc",
            {"endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": False}}]},
        )
        await eventually(lambda: pinned(1) == 503, "rank 1 to leave rotation")

        def unpinned() -> set[int]:
            return {served_by(complete(router.base_url, model, f"q{i}")) for i in range(6)}

        assert await asyncio.to_thread(unpinned) <= {0, 2}
        # Scale down: rank 2's Service and slice go away: pinning it is a 400 again.
        await send("DELETE", f"{SLICES}/chat-rank-2-abc")
        await eventually(lambda: pinned(2) == 400, "rank 2 to leave")
        assert router.proc.poll() is None
    finally:
        await asyncio.to_thread(router.stop)


def _ready(router: RunningRouter) -> bool:
    try:
        return httpx.get(f"{router.base_url}/readiness", timeout=2).status_code == 200
    except httpx.HTTPError:
        if router.proc.poll() is not None:
            raise AssertionError(router.output()) from None
        return False


# --- a rank dies under load (keep this last: the rank stays dead) ------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_stop_signal_lets_streams_in_flight_finish_then_the_router_exits_0(
    ranks: list[RunningServer], model: str, sig: signal.Signals
) -> None:
    own = RunningRouter("--worker-urls", ranks[0].base_url, "--policy", "round_robin").wait_ready()
    try:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Describe a harbour at dawn."}],
            "max_tokens": 40,
            "ignore_eos": True,
            "stream": True,
        }
        events: list[str] = []
        with httpx.stream(
            "POST", f"{own.base_url}/v1/chat/completions", json=body, timeout=TIMEOUT
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    if len(events) == 2:  # streaming: now stop the router under it
                        os.killpg(own.proc.pid, sig)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert own.proc.wait(30) == 0
    finally:
        own.stop()


def kill_rank(rank: RunningServer) -> None:
    """SIGKILL the rank's API process and its engine: a crash, not a drain."""
    pids = [rank.proc.pid, *rank.child_pids()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    rank.proc.wait(10)


def test_killing_a_rank_under_load_fails_no_request_that_had_not_started_streaming(
    router: RunningRouter, ranks: list[RunningServer], model: str
) -> None:
    before = scrape(router.base_url)
    # Routing keys spread the load evenly and deterministically: a third prefers rank 2.
    keys = [f"cargo-{i}" for i in range(200)]
    by_rank = {r: [k for k in keys if rendezvous_order(k, range(3))[0] == r] for r in range(3)}
    work = [(kind, by_rank[r][j]) for j in range(4) for r in range(3) for kind in ("plain", "sse")]
    # Long enough that rank 2 is seen holding six at once on a fast host (16 tokens could all
    # finish between two polls; 64 take under half a second at 150 tokens/s a stream).
    tokens = 128

    def run(kind: str, key: str) -> tuple[str, int, int, str]:
        body = {
            "model": model,
            "prompt": f"Cargo manifest {key}: list the containers.",
            "max_tokens": tokens,
            "ignore_eos": True,
            "temperature": 0,
            "routing_key": key,
        }
        url = f"{router.base_url}/v1/completions"
        if kind == "plain":
            r = httpx.post(url, json=body, timeout=TIMEOUT)
            return kind, r.status_code, int(r.headers.get("x-data-parallel-rank", -1)), r.text
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=TIMEOUT) as r:
            text = "".join(r.iter_text())
            return kind, r.status_code, int(r.headers.get("x-data-parallel-rank", -1)), text

    with ThreadPoolExecutor(max_workers=len(work)) as pool:
        futures = [pool.submit(run, kind, key) for kind, key in work]
        # Kill rank 2 while it holds requests of both kinds.
        wait_for(lambda: router.workers()[2]["in_flight"] >= 6, 30, 0.02, what="load on rank 2")
        kill_rank(ranks[2])
        results = [f.result(timeout=TIMEOUT) for f in futures]

    broken = 0
    for kind, status, rank, text in results:
        assert status == 200, (kind, status, text)
        if kind == "plain":
            assert json.loads(text)["usage"]["completion_tokens"] == tokens
            continue
        assert text.rstrip().endswith("data: [DONE]"), text
        if '"error"' in text:
            # Only a stream that had already started on the killed rank may break.
            assert rank == 2, text
            broken += 1
    after = scrape(router.base_url)
    # Requests rank 2 held but had not started answering were moved to other ranks.
    retries = metric(after, "berth:router_retries_total") - metric(
        before, "berth:router_retries_total"
    )
    assert retries >= 1 and broken <= 4
    assert sum(1 for kind, _, rank, _ in results if kind == "plain" and rank != 2) >= 8

    # The router stops sending to the dead rank.
    wait_for(lambda: not router.workers()[2]["routable"], 10, what="rank 2 out of rotation")
    served = [served_by(complete(router.base_url, model, f"After {i}")) for i in range(9)]
    assert 2 not in served
    assert_openai_error(
        complete(router.base_url, model, "x", headers={"X-Data-Parallel-Rank": "2"}),
        503,
        "rank_unavailable",
    )
    assert httpx.get(f"{router.base_url}/health").json()["healthy_ranks"] == [0, 1]
