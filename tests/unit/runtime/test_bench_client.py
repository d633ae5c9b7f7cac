"""The load generator against a fake streaming server: payloads, timings, limits, failures."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from berth_common.http import SSE_DONE, sse_event
from berth_runtime.bench.client import BenchConfig, run_benchmark_async
from berth_runtime.bench.workload import BenchRequest


class FakeServer:
    """An OpenAI-style SSE server on a loopback port: one chunk per token, `gap` seconds apart,
    usage at the end."""

    def __init__(self, gap: float = 0.01, fail_every: int = 0, stream_error_on: int = -1) -> None:
        self.gap = gap
        self.fail_every = fail_every
        self.stream_error_on = stream_error_on
        self.payloads: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.flushed = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/flush_cache", self.flush)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_post("/v1/completions", self.generate)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake-model"}]})

    async def flush(self, request: web.Request) -> web.Response:
        self.flushed += 1
        return web.json_response({"success": True})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        self.payloads.append(payload)
        index = len(self.payloads)
        if self.fail_every and index % self.fail_every == 0:
            return web.json_response({"message": "queue full"}, status=503)
        chat = request.path.endswith("/chat/completions")
        n = payload["max_tokens"]
        prompt_tokens = len(payload["messages"][0]["content"].split()) if chat else 0
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if chat:
                await response.write(
                    _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                )
            for k in range(n):
                await asyncio.sleep(self.gap)
                if index == self.stream_error_on and k == 1:
                    await response.write(_sse({"error": {"message": "engine died"}}))
                    return response
                piece = {"delta": {"content": f" t{k}"}} if chat else {"text": f" t{k}"}
                await response.write(_sse({"choices": [{"index": 0, **piece}]}))
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": n,
                "prompt_tokens_details": {"cached_tokens": 2},
            }
            await response.write(_sse({"choices": [], "usage": usage}))
        finally:
            self.in_flight -= 1
        # The client stops reading at [DONE]: count the request done before sending it.
        await response.write(SSE_DONE.encode())
        return response


def _sse(obj: dict) -> bytes:
    return sse_event(obj).encode()


def _requests(n: int, words: int = 5, out: int = 4) -> list[BenchRequest]:
    reqs = []
    for i in range(n):
        text = " ".join(f"w{i}_{k}" for k in range(words))
        reqs.append(
            BenchRequest(
                prompt=text,
                prompt_ids=list(range(words)),
                output_len=out,
                messages=[{"role": "user", "content": text}],
            )
        )
    return reqs


async def run(server: FakeServer, reqs: list[BenchRequest], **cfg) -> dict:
    runner = web.AppRunner(server.app())
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    await web.SockSite(runner, sock).start()
    try:
        config = BenchConfig(base_url=f"http://127.0.0.1:{port}/v1", disable_tqdm=True, **cfg)
        return await run_benchmark_async(config, reqs)
    finally:
        await runner.cleanup()


async def test_closed_loop_streams_and_measures():
    server = FakeServer(gap=0.01)
    result = await run(server, _requests(6), concurrency=2)
    assert result["model"] == "fake-model"
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 6 * 4
    assert result["total_input_tokens"] == 6 * 5
    assert result["prompt_tokens_mismatched"] == 0
    assert result["total_cached_tokens"] == 12
    assert server.max_in_flight == 2
    # One warm-up request (not a workload prompt), then the six.
    assert len(server.payloads) == 7
    assert server.payloads[0]["messages"][0]["content"] == "Say hello."
    payload = server.payloads[1]
    assert payload["model"] == "fake-model"
    assert payload["ignore_eos"] is True and payload["max_tokens"] == 4
    assert payload["stream"] is True and payload["stream_options"] == {"include_usage": True}
    assert payload["temperature"] == 0.0
    for r in result["requests"]:
        assert r["success"] and r["output_tokens"] == 4 and len(r["chunk_times"]) == 4
        assert r["ttft"] >= 0.009 and r["ttft"] == r["chunk_times"][0]
        assert all(gap >= 0.009 for gap in r["itl"]) and len(r["itl"]) == 3
        assert r["latency"] >= r["chunk_times"][-1]
    ttft = result["ttft_ms"]
    assert ttft["p50"] <= ttft["p90"] <= ttft["p99"]
    # Two at a time, three rounds of about 40 ms each.
    assert result["duration_s"] >= 0.1


async def test_completions_api_and_unbounded_concurrency():
    server = FakeServer(gap=0.005)
    result = await run(server, _requests(5), api="completions", warmup_requests=0, model="m")
    assert result["completed"] == 5
    assert server.max_in_flight == 5
    assert all(p["prompt"].startswith("w") and "messages" not in p for p in server.payloads)
    assert {p["model"] for p in server.payloads} == {"m"}


async def test_open_loop_rate_spaces_requests():
    server = FakeServer(gap=0.001)
    result = await run(server, _requests(5, out=1), request_rate=50.0, seed=1, warmup_requests=0)
    starts = sorted(r["start"] for r in result["requests"])
    assert starts[-1] > 0.02  # Poisson arrivals at 50/s: 4 gaps of 20 ms on average
    assert result["request_rate"] == 50.0


async def test_failures_are_recorded_not_raised():
    server = FakeServer(gap=0.001, fail_every=3, stream_error_on=2)
    result = await run(server, _requests(6), concurrency=1, warmup_requests=0, flush_cache=True)
    assert server.flushed == 1 and result["cache_flushed"] is True
    assert result["failed"] == 3 and result["completed"] == 3
    assert any(e.startswith("HTTP 503") for e in result["errors"])
    assert "stream error: engine died" in result["errors"]


async def test_failed_warmup_stops_the_run():
    server = FakeServer(fail_every=1)
    with pytest.raises(RuntimeError, match="warm-up"):
        await run(server, _requests(1))
