"""Scraping the ranks: their addresses from the pods, and their load from the runtime's own
`/metrics` text, over real HTTP on loopback."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from berth_common.server_process import free_port
from berth_operator import constants as c
from berth_operator import scrape
from berth_operator.scrape import RankSample, RankTarget, parse_metrics, rank_targets
from berth_runtime.io_struct import SchedulerStats
from berth_runtime.metrics import MetricsCollector

HEARTBEAT = 1_767_225_600.25


def runtime_metrics(**overrides: Any) -> str:
    """What a rank's `/metrics` serves, rendered by the runtime's own collector."""
    collector = MetricsCollector("llama", 3)
    collector.set_engine_info(context_len=8192, max_total_num_tokens=1000)
    fields: dict[str, Any] = {
        "time": HEARTBEAT,
        "num_running_reqs": 3,
        "num_waiting_reqs": 5,
        "num_used_tokens": 600,
        "num_cached_tokens": 100,
        "max_total_num_tokens": 1000,
        "gen_throughput": 123.5,
        "cache_hit_rate": 0.25,
        "step_count": 42,
        "generated_tokens": 7777,
    }
    collector.observe_stats(SchedulerStats(**{**fields, **overrides}))
    # Per-request and HTTP metrics are in the same text: they must not confuse the parser.
    collector.observe_first_token(received_time=0.0, now=0.2)
    collector.observe_finished(
        received_time=0.0,
        tokenized_time=0.01,
        scheduled_time=0.02,
        prompt_tokens=10,
        completion_tokens=20,
        cached_tokens=5,
        aborted=False,
        now=1.0,
    )
    collector.http_requests.labels("/v1/completions", "POST").inc()
    return collector.render().decode()


EXPECTED = {
    "queued": 5.0,
    "running": 3.0,
    "token_usage": 0.6,
    "gen_throughput": 123.5,
    "generated_tokens": 7777.0,
    "steps": 42.0,
    "heartbeat": HEARTBEAT,
}


# --- targets -----------------------------------------------------------------------------------


def rank_pod(
    name: str,
    ip: str | None = "10.0.0.7",
    *,
    index: str | None = None,
    uid: str = "uid",
    ready: bool = True,
    ports: list[dict[str, Any]] | None = None,
    terminating: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": uid, "labels": {}}
    if index is not None:
        meta["labels"][c.POD_INDEX_LABEL] = index
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ]
    }
    if ip is not None:
        status["podIP"] = ip
    container = {"name": "runtime", "ports": ports if ports is not None else []}
    return {"metadata": meta, "spec": {"containers": [container]}, "status": status}


def test_targets_are_the_addressed_rank_pods_by_rank() -> None:
    pods = [
        rank_pod("chat-2", "10.0.0.12", index="2", uid="u2"),
        rank_pod("chat-0", "10.0.0.10", uid="u0", ports=[{"name": "http", "containerPort": 9000}]),
        rank_pod("chat-1", None, index="1"),  # no address yet
        rank_pod("chat-3", "10.0.0.13", index="3", terminating=True),
        rank_pod("chat-4", "fd00::4", index="4", uid="u4", ready=False),
        rank_pod("chat-router-7d9f", "10.0.0.99"),  # not an ordinal
    ]
    assert rank_targets(pods) == [
        RankTarget(0, "chat-0", "u0", "http://10.0.0.10:9000", ready=True),
        RankTarget(2, "chat-2", "u2", f"http://10.0.0.12:{c.HTTP_PORT}", ready=True),
        RankTarget(4, "chat-4", "u4", f"http://[fd00::4]:{c.HTTP_PORT}", ready=False),
    ]


def test_the_pod_index_label_wins_over_the_name() -> None:
    (target,) = rank_targets([rank_pod("chat-0", index="5")])
    assert target.rank == 5
    assert rank_targets([rank_pod("chat-0", index="five")]) == []


@pytest.mark.parametrize(
    ("ports", "port"),
    [
        ([], c.HTTP_PORT),
        ([{"name": "metrics", "containerPort": 9100}], c.HTTP_PORT),
        (
            [{"name": "metrics", "containerPort": 9100}, {"name": "http", "containerPort": 8080}],
            8080,
        ),
        ([{"name": "http"}], c.HTTP_PORT),
    ],
)
def test_the_container_port_named_http_is_used(ports: list[dict[str, Any]], port: int) -> None:
    (target,) = rank_targets([rank_pod("chat-0", ports=ports)])
    assert target.url == f"http://10.0.0.7:{port}"
    assert c.HTTP_PORT == 8000


def test_readiness_comes_from_the_ready_condition() -> None:
    pod = rank_pod("chat-0")
    del pod["status"]["conditions"]
    bare = {"metadata": {"name": "chat-1"}, "status": {"podIP": "10.0.0.1"}}
    assert [t.ready for t in rank_targets([pod, bare, rank_pod("chat-2", ready=False)])] == [
        False,
        False,
        False,
    ]
    assert rank_targets([rank_pod("chat-0", ready=True)])[0].ready is True


# --- the runtime's metrics text ----------------------------------------------------------------


def test_the_runtime_exports_every_metric_the_operator_reads() -> None:
    names = {line.split("{")[0] for line in runtime_metrics().splitlines() if line[:1] != "#"}
    assert set(scrape.METRICS) <= names


def test_parse_metrics_of_the_runtimes_own_output() -> None:
    values = parse_metrics(runtime_metrics())
    assert values == pytest.approx(EXPECTED)
    assert values["heartbeat"] == HEARTBEAT  # a Unix time survives the text format exactly


def test_parse_metrics_sums_label_sets_skips_nan_and_ignores_other_metrics() -> None:
    text = (
        "# TYPE sglang:num_queue_reqs gauge\n"
        'sglang:num_queue_reqs{dp_rank="0"} 2\n'
        'sglang:num_queue_reqs{dp_rank="1"} 3\n'
        "# TYPE sglang:token_usage gauge\n"
        "sglang:token_usage NaN\n"
        "# TYPE sglang:num_used_tokens gauge\n"
        "sglang:num_used_tokens 512\n"
    )
    assert parse_metrics(text) == {"queued": 5.0}
    assert parse_metrics("") == {}


def test_parse_metrics_refuses_what_is_not_the_text_format() -> None:
    with pytest.raises(ValueError):
        parse_metrics("<html><body>502 Bad Gateway</body></html>")


# --- scraping over HTTP ------------------------------------------------------------------------


class _Rank(ThreadingHTTPServer):
    daemon_threads = True
    status: int = 200
    body: str = ""
    load: str = ""
    delay: float = 0.0
    paths: list[str]

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that timed out closed the socket: nothing to report


class _Handler(BaseHTTPRequestHandler):
    server: _Rank

    def do_GET(self) -> None:
        self.server.paths.append(self.path)
        time.sleep(self.server.delay)
        is_load = self.path == c.LOAD_PATH
        payload = (self.server.load if is_load else self.server.body).encode()
        self.send_response(self.server.status)
        kind = "application/json" if is_load else "text/plain; version=0.0.4"
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        pass


Serve = Callable[..., _Rank]
IDLE_LOAD = json.dumps({"num_inflight_requests": 0, "phase": "ready"})


@pytest.fixture
def serve() -> Iterator[Serve]:
    """Start a tiny HTTP server on loopback: `body` at /metrics, `load` (JSON) at /get_load."""
    started: list[_Rank] = []

    def start(
        body: str = "",
        status: int = 200,
        delay: float = 0.0,
        host: str = "127.0.0.1",
        load: str = IDLE_LOAD,
    ) -> _Rank:
        server_class = _Rank
        if ":" in host:
            server_class = type("_Rank6", (_Rank,), {"address_family": socket.AF_INET6})
        server = server_class((host, 0), _Handler)
        server.body, server.status, server.delay, server.paths = body, status, delay, []
        server.load = load
        threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def target_of(server: _Rank | None, rank: int = 0, *, port: int | None = None) -> RankTarget:
    host = "127.0.0.1"
    if server is not None:
        host, port = server.server_address[:2]  # type: ignore[misc]
    pod = rank_pod(
        f"chat-{rank}",
        str(host),
        uid=f"uid-{rank}",
        ports=[{"name": "http", "containerPort": port}],
    )
    (target,) = rank_targets([pod])
    return target


async def scrape_one(target: RankTarget, now: float = 1234.5) -> RankSample:
    async with httpx.AsyncClient(trust_env=False) as client:
        return await scrape.scrape(client, target, now)


async def test_scrape_reads_a_ranks_metrics(serve: Serve) -> None:
    server = serve(runtime_metrics())
    sample = await scrape_one(target_of(server, rank=3))
    assert sorted(server.paths) == sorted([c.METRICS_PATH, c.LOAD_PATH])
    assert sample.ok and sample.error is None
    assert (sample.rank, sample.pod, sample.uid, sample.time, sample.ready) == (
        3,
        "chat-3",
        "uid-3",
        1234.5,
        True,
    )
    assert (sample.queued, sample.running, sample.steps) == (5, 3, 42)
    assert isinstance(sample.queued, int) and isinstance(sample.running, int)
    assert sample.token_usage == pytest.approx(0.6)
    assert sample.gen_throughput == pytest.approx(123.5)
    assert sample.generated_tokens == 7777
    assert sample.heartbeat == HEARTBEAT
    assert sample.busy


async def test_an_idle_rank_is_not_busy(serve: Serve) -> None:
    server = serve(runtime_metrics(num_running_reqs=0, num_waiting_reqs=0))
    sample = await scrape_one(target_of(server))
    assert sample.ok and not sample.busy and sample.idle
    assert (sample.inflight, sample.phase) == (0, "ready")


async def test_requests_in_the_api_process_keep_a_rank_from_being_idle(serve: Serve) -> None:
    # The scheduler is done, but a response is still streaming out: not safe to remove.
    load = json.dumps({"num_inflight_requests": 2, "phase": "ready"})
    server = serve(runtime_metrics(num_running_reqs=0, num_waiting_reqs=0), load=load)
    sample = await scrape_one(target_of(server))
    assert sample.ok and not sample.busy and not sample.idle and sample.inflight == 2


async def test_a_load_endpoint_that_is_not_json_is_a_failed_sample(serve: Serve) -> None:
    sample = await scrape_one(target_of(serve(runtime_metrics(), load="<html>")))
    assert not sample.ok and sample.error


async def test_a_runtime_without_the_berth_metrics_reads_as_zero(serve: Serve) -> None:
    text = "# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs 4\n"
    sample = await scrape_one(target_of(serve(text)))
    assert sample.ok
    assert (sample.queued, sample.heartbeat, sample.steps, sample.generated_tokens) == (4, 0, 0, 0)


async def test_a_closed_port_is_a_failed_sample_not_an_error() -> None:
    sample = await scrape_one(target_of(None, rank=1, port=free_port()))
    assert not sample.ok
    assert sample.error is not None and sample.error.startswith("ConnectError")
    assert (sample.rank, sample.pod, sample.time, sample.queued) == (1, "chat-1", 1234.5, 0)


async def test_a_server_error_is_a_failed_sample(serve: Serve) -> None:
    sample = await scrape_one(target_of(serve("boom", status=500)))
    assert not sample.ok
    assert sample.error is not None
    assert sample.error.startswith("HTTPStatusError") and "500" in sample.error


async def test_a_page_that_is_not_metrics_is_a_failed_sample(serve: Serve) -> None:
    sample = await scrape_one(target_of(serve("<html><body>hello</body></html>")))
    assert not sample.ok
    assert sample.error is not None and sample.error.startswith("ValueError")


async def test_a_slow_rank_times_out(serve: Serve, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scrape, "SCRAPE_TIMEOUT_SECONDS", 0.2)
    started = time.monotonic()
    sample = await scrape_one(target_of(serve(runtime_metrics(), delay=1.0)))
    assert time.monotonic() - started < 0.9
    assert not sample.ok
    assert sample.error is not None and "Timeout" in sample.error


async def test_scrape_over_ipv6(serve: Serve) -> None:
    try:
        server = serve(runtime_metrics(), host="::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    target = target_of(server)
    assert target.url.startswith("http://[::1]:")
    sample = await scrape_one(target)
    assert sample.ok and sample.queued == 5


async def test_scrape_all_asks_every_rank_at_once_and_keeps_their_order(serve: Serve) -> None:
    slow = [serve(runtime_metrics(num_waiting_reqs=rank), delay=0.6) for rank in range(3)]
    targets = [target_of(server, rank) for rank, server in enumerate(slow)]
    targets.append(target_of(None, 3, port=free_port()))
    started = time.monotonic()
    async with httpx.AsyncClient(trust_env=False) as client:
        samples = await scrape.scrape_all(client, targets, 99.0)
    elapsed = time.monotonic() - started
    assert elapsed < 1.4, f"{elapsed:.2f}s: the ranks were asked one after the other"
    assert [s.rank for s in samples] == [0, 1, 2, 3]
    assert [s.ok for s in samples] == [True, True, True, False]
    assert [s.queued for s in samples] == [0, 1, 2, 0]
    assert {s.time for s in samples} == {99.0}


async def test_scrape_all_of_nothing() -> None:
    async with httpx.AsyncClient(trust_env=False) as client:
        assert await scrape.scrape_all(client, [], 0.0) == []


async def test_an_infinite_value_is_a_failed_sample_not_an_error(serve: Serve) -> None:
    text = "# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs +Inf\n"
    sample = await scrape_one(target_of(serve(text)))
    assert not sample.ok
