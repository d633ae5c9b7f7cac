"""Health tells the truth: loading -> ready, a wedged engine turns 503 (and recovers), and the
watchdog ends a server whose engine stays wedged."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from berth_runtime.entrypoints.http_server import HEARTBEAT_STALE_S
from tests.helpers import RunningServer, embedded_model_dir, scheduler_process, wait_for


def test_health_reports_loading_then_ready_with_progress():
    srv = RunningServer("--model", embedded_model_dir())
    phases = []
    try:

        def poll() -> bool:
            try:
                resp = httpx.get(f"{srv.base_url}/health", timeout=2)
            except httpx.HTTPError:
                return False
            phases.append((resp.status_code, resp.json()["status"]))
            return resp.status_code == 200

        wait_for(poll, 120, interval=0.05, what="ready")
        assert (503, "loading") in phases, phases
        info = httpx.get(f"{srv.base_url}/get_server_info").json()
        assert info["phase"] == "ready" and info["load_time_s"] > 0
        progress = info["load_progress"]
        assert progress["tensors_done"] == progress["tensors_total"] > 0
        assert progress["bytes_done"] == progress["bytes_total"] > 0
        assert "loading weights" in srv.output() and "warming up" in srv.output()
    finally:
        srv.stop()


def test_frozen_scheduler_turns_health_503_and_recovers():
    srv = RunningServer("--model", embedded_model_dir(), "--watchdog-timeout", "120").wait_ready()
    try:
        scheduler = scheduler_process(srv)
        scheduler.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: httpx.get(f"{srv.base_url}/health").status_code == 503, 10, what="503")
            assert "heartbeat" in httpx.get(f"{srv.base_url}/health").json()["reason"]
        finally:
            scheduler.send_signal(signal.SIGCONT)
        wait_for(lambda: httpx.get(f"{srv.base_url}/health").status_code == 200, 10, what="200")
    finally:
        assert srv.stop() == 0


def test_a_long_prefill_step_keeps_health_200():
    # One unchunked step of about 3,000 prompt tokens: seconds on a small CPU, during which the
    # scheduler sends no heartbeat. Before the step reporter, /health turned 503 after 5 s.
    srv = RunningServer(
        "--model",
        embedded_model_dir(),
        "--chunked-prefill-size",
        "0",
        "--max-prefill-tokens",
        "4096",
    ).wait_ready()
    try:
        prompt = " ".join(f"harbour{i}" for i in range(1000))  # ~3,000 tokens
        result: dict = {}

        def prefill() -> None:
            started = time.monotonic()
            body = {"text": prompt, "sampling_params": {"max_new_tokens": 1}}
            result["r"] = httpx.post(f"{srv.base_url}/generate", json=body, timeout=300)
            result["s"] = time.monotonic() - started

        t = threading.Thread(target=prefill)
        t.start()
        statuses = []
        while t.is_alive():
            statuses.append(httpx.get(f"{srv.base_url}/health", timeout=5).status_code)
            time.sleep(0.25)
        t.join()
        assert result["r"].status_code == 200, result["r"].text
        assert result["r"].json()["meta_info"]["prompt_tokens"] > 2500
        if result["s"] < HEARTBEAT_STALE_S + 1:
            pytest.skip(f"the step took {result['s']:.1f}s here: too fast to outlast the heartbeat")
        assert set(statuses) == {200}, statuses
    finally:
        assert srv.stop() == 0


def test_watchdog_fails_requests_and_exits_when_the_engine_stays_wedged():
    srv = RunningServer("--model", embedded_model_dir(), "--watchdog-timeout", "3").wait_ready()
    try:
        result: dict = {}
        body = {"text": "Go:", "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
        t = threading.Thread(
            target=lambda: result.update(
                r=httpx.post(f"{srv.base_url}/generate", json=body, timeout=60)
            )
        )
        t.start()
        wait_for(
            lambda: httpx.get(f"{srv.base_url}/get_load").json()["num_inflight_requests"] == 1,
            30,
            what="the request to start",
        )
        scheduler_process(srv).send_signal(signal.SIGSTOP)
        t.join(30)
        assert result["r"].status_code >= 500
        assert srv.proc.wait(30) != 0
        assert "watchdog" in srv.output()
    finally:
        srv.stop()
