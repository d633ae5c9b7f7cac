"""The load generator: streams a workload to an OpenAI-compatible server and times every chunk.

Closed loop (`concurrency`: at most N requests in flight, the next one sent when one finishes),
open loop (`request_rate`: Poisson arrivals from a seeded generator), or both (Poisson arrivals
capped at N in flight). Output lengths are forced with `ignore_eos` and `max_tokens`, greedy by
default. Works against Berth, SGLang, vLLM or llama.cpp's server alike.

HTTP goes through aiohttp, as in `sglang.bench_serving`: the client shares the machine with the
server under test, and aiohttp's C parser costs about a third of httpx's CPU per streamed chunk
(measured: 48 vs 121 us), CPU the server would otherwise lose.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import math
import os
import platform
import random
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from berth_runtime.bench.memory import MemorySampler
from berth_runtime.bench.metrics import RequestResult, summarize
from berth_runtime.bench.workload import Api, BenchRequest

WARMUP_PROMPT = "Say hello."


@dataclass
class BenchConfig:
    """How to drive the server (everything but the prompts)."""

    base_url: str = "http://127.0.0.1:30000"
    api: Api = "chat"
    model: str | None = None  # None: the first id of GET /v1/models
    concurrency: int | None = None  # None: unbounded
    request_rate: float = math.inf  # requests/s, Poisson; inf: all at once
    seed: int = 0
    warmup_requests: int = 1
    ignore_eos: bool = True
    temperature: float = 0.0
    request_timeout: float = 3 * 3600.0
    api_key: str | None = None
    server_pid: int | None = None  # sum RSS over this process tree
    disable_tqdm: bool = False
    flush_cache: bool = False  # POST /flush_cache before the timed run (Berth, SGLang)
    extra_body: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None  # counts output tokens when the server reports no usage
    label: str = ""  # the system's name in reports
    keep_text: bool = False  # each request's generated text in the result (answers compared)


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds after the start) of `n` requests arriving at `rate` per second:
    exponential gaps from a seeded generator; all zero when the rate is infinite."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError("the request rate must be positive")
    rng = random.Random(seed)
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + rng.expovariate(rate))
    return times


def _root(base_url: str) -> str:
    """The server root: accepts `http://host:port`, `.../v1` or `.../v1/`."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _is_loopback(base_url: str) -> bool:
    host = urlsplit(base_url).hostname or ""
    return host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")


def build_payload(request: BenchRequest, cfg: BenchConfig, model: str, max_tokens: int) -> dict:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.api == "chat":
        if request.messages is None:
            raise ValueError("this workload was built for the completions API")
        payload["messages"] = request.messages
    else:
        payload["prompt"] = request.prompt
    if cfg.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(cfg.extra_body)
    return payload


def _chunk_text(chunk: dict[str, Any], api: Api) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        if api == "chat":
            text += (choice.get("delta") or {}).get("content") or ""
        else:
            text += choice.get("text") or ""
    return text


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    request: BenchRequest,
    api: Api,
    tokenizer: Any = None,
) -> RequestResult:
    """Send one streaming request; time its chunks. Never raises: failures are in the result."""
    result = RequestResult(prompt_len=request.prompt_len, output_len=payload["max_tokens"])
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    start = time.perf_counter()
    result.start = start
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                body = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {body[:500]}"
                return result
            async for raw_line in response.content:
                if not raw_line.startswith(b"data:"):
                    continue
                data = raw_line[len(b"data:") :].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter() - start
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    result.error = f"stream error: {message}"
                    return result
                if chunk.get("usage"):
                    usage = chunk["usage"]
                text = _chunk_text(chunk, api)
                if text:
                    if not result.chunk_times:
                        result.ttft = now
                    result.chunk_times.append(now)
                    parts.append(text)
        result.latency = time.perf_counter() - start
    except Exception as err:  # the benchmark records failures instead of stopping
        result.error = f"{type(err).__name__}: {err}"
        return result
    result.generated_text = "".join(parts)
    if not result.chunk_times:
        result.ttft = result.latency
    if usage and usage.get("completion_tokens") is not None:
        result.output_tokens = int(usage["completion_tokens"])
        result.server_prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens")
    elif tokenizer is not None:
        result.output_tokens = len(
            tokenizer.encode(result.generated_text, add_special_tokens=False)
        )
    else:
        result.output_tokens = len(result.chunk_times)
    result.success = True
    return result


async def detect_model(session: aiohttp.ClientSession, root: str) -> str:
    async with session.get(f"{root}/v1/models") as response:
        response.raise_for_status()
        models = (await response.json(content_type=None)).get("data") or []
    if not models:
        raise RuntimeError(f"{root}/v1/models lists no model")
    return str(models[0]["id"])


async def flush_cache(session: aiohttp.ClientSession, root: str, attempts: int = 20) -> bool:
    """Empty the server's prefix cache (Berth and SGLang; 400 while busy, so retry)."""
    for _ in range(attempts):
        try:
            async with session.post(f"{root}/flush_cache") as response:
                status = response.status
        except aiohttp.ClientError:
            return False
        if status == 200:
            return True
        if status in (404, 405):
            return False
        await asyncio.sleep(0.25)
    return False


async def run_benchmark_async(cfg: BenchConfig, requests: list[BenchRequest]) -> dict[str, Any]:
    """Run the workload; the result dict holds the config, the summary and every request."""
    if not requests:
        raise ValueError("the workload is empty")
    root = _root(cfg.base_url)
    url = f"{root}/v1/chat/completions" if cfg.api == "chat" else f"{root}/v1/completions"
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limit = cfg.concurrency or len(requests)
    async with aiohttp.ClientSession(
        headers=headers,
        connector=aiohttp.TCPConnector(limit=limit + 4),
        timeout=aiohttp.ClientTimeout(total=cfg.request_timeout, sock_connect=60.0),
        trust_env=not _is_loopback(root),
        read_bufsize=2**16,
    ) as client:
        model = cfg.model or await detect_model(client, root)
        for _ in range(cfg.warmup_requests):
            # Not a workload prompt: the warm-up must not seed the prefix cache with one.
            warmup = BenchRequest(
                prompt=WARMUP_PROMPT,
                prompt_ids=[],
                output_len=min(requests[0].output_len, 16),
                messages=[{"role": "user", "content": WARMUP_PROMPT}],
            )
            payload = build_payload(warmup, cfg, model, warmup.output_len)
            warm = await send_request(client, url, payload, warmup, cfg.api, cfg.tokenizer)
            if not warm.success:
                raise RuntimeError(f"the warm-up request failed: {warm.error}")
        flushed = await flush_cache(client, root) if cfg.flush_cache else None

        sampler = MemorySampler(cfg.server_pid).start() if cfg.server_pid else None
        arrivals = poisson_arrivals(len(requests), cfg.request_rate, cfg.seed)
        semaphore = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
        progress = _progress(len(requests), cfg.disable_tqdm, cfg.label)

        async def one(request: BenchRequest, send_at: float) -> RequestResult:
            delay = start + send_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with semaphore if semaphore else contextlib.nullcontext():
                payload = build_payload(request, cfg, model, request.output_len)
                result = await send_request(client, url, payload, request, cfg.api, cfg.tokenizer)
            if progress is not None:
                progress.update(1)
            return result

        start = time.perf_counter()
        results = await asyncio.gather(*(one(r, t) for r, t in zip(requests, arrivals)))
        duration = time.perf_counter() - start
        if progress is not None:
            progress.close()
        memory = sampler.stop() if sampler else None

    for result in results:
        result.start -= start
    summary = summarize(results, duration)
    mismatched = sum(
        1
        for r in results
        if r.success
        and r.server_prompt_tokens is not None
        and r.server_prompt_tokens != r.prompt_len
    )
    return {
        "backend": cfg.label or root,
        "base_url": root,
        "model": model,
        "api": cfg.api,
        "num_prompts": len(requests),
        "concurrency": cfg.concurrency,
        "request_rate": cfg.request_rate if not math.isinf(cfg.request_rate) else "inf",
        "seed": cfg.seed,
        "ignore_eos": cfg.ignore_eos,
        "temperature": cfg.temperature,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "cache_flushed": flushed,
        **summary,
        "prompt_tokens_mismatched": mismatched,
        "server_memory": memory,
        "requests": [r.to_dict(with_text=cfg.keep_text) for r in results],
    }


def run_benchmark(cfg: BenchConfig, requests: list[BenchRequest]) -> dict[str, Any]:
    """Blocking wrapper of `run_benchmark_async`."""
    return asyncio.run(run_benchmark_async(cfg, requests))


def _progress(total: int, disable: bool, label: str) -> Any:
    if disable:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=label or "requests", unit="req", leave=False)
