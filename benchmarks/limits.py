"""Measure how `berth serve` holds up to oversized input and stop signals: the figures that the
README's "Limits and behaviour under failure" quotes.

    python -m benchmarks.limits          # or: make bench-limits

One real `berth serve` on the embedded model at its defaults. While each hostile request runs, a
prober thread asks `/health` every 20 ms on its own connection, as a liveness probe would, and
records how long each answer took:

1. a 20 MB chat body with a Content-Length: the time to its 413;
2. the same 20 MB sent chunked (no Content-Length): the time to its 413;
3. a prompt just under the body limit with more characters than the context could hold: the
   time to its 400, which comes before any tokenizing;
4. a 6,000-token prompt generating one token: a real prefill on the same busy cores.

Then `--streams` streams run and the whole process group gets SIGTERM (what `docker stop` behind
an init, systemd or a shell's Ctrl-C sends): how many streams finish whole, how long the drain
takes, and the exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx

from berth_common.server_process import ServerProcess, berth_server

CHAT = "/v1/chat/completions"
RAW = {"content-type": "application/json"}
PROBE_INTERVAL_S = 0.02


@dataclass
class HealthProbe:
    """GET /health every PROBE_INTERVAL_S on one keep-alive connection, until stopped."""

    base_url: str
    latencies_ms: list[float] = field(default_factory=list)
    failures: int = 0  # answers other than 200, and timeouts
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> HealthProbe:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=10, trust_env=False) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    ok = client.get("/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies_ms.append((time.perf_counter() - started) * 1000)
                self.failures += not ok
                self._stop.wait(PROBE_INTERVAL_S)


@dataclass(frozen=True)
class Measured:
    scenario: str
    status: int
    seconds: float
    health_p50_ms: float
    health_max_ms: float
    health_probes: int
    health_failures: int


def measure(base_url: str, scenario: str, send: Callable[[httpx.Client], int]) -> Measured:
    with httpx.Client(base_url=base_url, timeout=600, trust_env=False) as client:
        client.get("/health")  # connect before the clock starts
        with HealthProbe(base_url) as probe:
            time.sleep(0.2)  # a few probes before, as a baseline
            started = time.perf_counter()
            status = send(client)
            seconds = time.perf_counter() - started
    lat = probe.latencies_ms or [0.0]
    return Measured(
        scenario,
        status,
        seconds,
        statistics.median(lat),
        max(lat),
        len(probe.latencies_ms),
        probe.failures,
    )


def chat_body(content: str, max_tokens: int = 1) -> bytes:
    return json.dumps(
        {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    ).encode()


def chunked(body: bytes, size: int = 2**16) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]


def hostile_requests(base_url: str, body_limit: int, context: int) -> list[Measured]:
    twenty_mb = chat_body("x" * 20_000_000)
    # Characters the context could never hold, in a body the limit lets through.
    too_long = chat_body("word " * ((body_limit - 1000) // 5))
    # 6,000 tokens ("hello" and " hello" are one token each) that fit the context.
    long_prompt = chat_body("hello " * 6000)
    assert context > 6200, f"the 6,000-token prompt needs a context above 6,200 (is {context})"
    return [
        measure(
            base_url,
            "20 MB body, Content-Length",
            lambda c: c.post(CHAT, content=twenty_mb, headers=RAW).status_code,
        ),
        measure(
            base_url,
            "20 MB body, chunked",
            lambda c: c.post(CHAT, content=chunked(twenty_mb), headers=RAW).status_code,
        ),
        measure(
            base_url,
            f"{len(too_long) / 2**20:.1f} MB prompt, over the context",
            lambda c: c.post(CHAT, content=too_long, headers=RAW).status_code,
        ),
        measure(
            base_url,
            "6k-token prompt, prefill + 1 token",
            lambda c: c.post(CHAT, content=long_prompt, headers=RAW).status_code,
        ),
    ]


@dataclass(frozen=True)
class Drained:
    streams: int
    completed: int
    drain_s: float
    exit_code: int | None


def stream_until_done(base_url: str, i: int, max_tokens: int, done: list[bool]) -> None:
    """One streaming chat; `done[i]` is True if it ended with every token and `[DONE]`."""
    body = {
        "messages": [{"role": "user", "content": f"Count from {i} upwards."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens, finished = None, False
    try:
        with httpx.stream("POST", f"{base_url}{CHAT}", json=body, timeout=300) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    finished = True
                elif line.startswith("data: ") and '"usage":{' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    except httpx.HTTPError:
        pass
    done[i] = finished and tokens == max_tokens


def group_sigterm(server: ServerProcess, streams: int, max_tokens: int) -> Drained:
    done = [False] * streams
    threads = [
        threading.Thread(target=stream_until_done, args=(server.base_url, i, max_tokens, done))
        for i in range(streams)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while httpx.get(f"{server.base_url}/get_load").json().get("num_running_reqs", 0) < streams:
        if time.monotonic() > deadline:
            raise RuntimeError("the streams never all ran")
        time.sleep(0.05)
    started = time.perf_counter()
    os.killpg(server.proc.pid, signal.SIGTERM)
    try:
        code: int | None = server.proc.wait(300)
    except Exception:
        code = None
    drain_s = time.perf_counter() - started
    for t in threads:
        t.join(60)
    return Drained(streams, sum(done), drain_s, code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8, help="streams running at the SIGTERM")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens each stream asks for")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args(argv)

    server = berth_server("serve", *args.server_args, name="berth-limits")
    try:
        server.wait_ready()
        info = httpx.get(f"{server.base_url}/get_server_info", timeout=10).json()
        body_limit = int(info["max_request_body_bytes"])
        context = int(info["engine"]["context_len"])
        rows = hostile_requests(server.base_url, body_limit, context)
        drained = group_sigterm(server, args.streams, args.max_tokens)
    finally:
        server.stop()

    limit_mib = body_limit / 2**20
    print(f"\nberth serve at its defaults: body limit {limit_mib:.0f} MiB, context {context}")
    print(f"/health asked every {PROBE_INTERVAL_S * 1000:.0f} ms while each request ran\n")
    print("| Request | Answer | Time to answer | /health p50 / max | /health not 200 |")
    print("|---|---|---|---|---|")
    for m in rows:
        print(
            f"| {m.scenario} | {m.status} | {m.seconds * 1000:,.0f} ms | "
            f"{m.health_p50_ms:.1f} / {m.health_max_ms:.1f} ms | "
            f"{m.health_failures} of {m.health_probes} |"
        )
    print(
        f"\nSIGTERM to the process group with {drained.streams} streams running "
        f"({args.max_tokens} tokens each): {drained.completed}/{drained.streams} finished whole, "
        f"drained and exited in {drained.drain_s:.1f} s, exit code {drained.exit_code}"
    )
    worst = max(m.health_max_ms for m in rows)
    print(f"worst /health answer over all four: {worst:.1f} ms (target < 100 ms)")
    failed = any(m.health_failures for m in rows) or drained.completed != drained.streams
    return 1 if failed or drained.exit_code != 0 else 0


if __name__ == "__main__":
    raise SystemExit(main())
