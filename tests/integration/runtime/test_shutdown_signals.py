"""SIGTERM and SIGINT mean one thing, whoever gets them: drain, finish every stream, exit 0.

`kill -TERM -- -PGID` (`docker stop` behind an init, systemd, supervisord, `timeout`, a shell's
Ctrl-C) reaches the scheduler and the detokenizer as well as the API process. Each case below
sends one signal to one target while streams run, on a real `berth serve`.
"""

from __future__ import annotations

import os
import signal
import threading

import httpx
import psutil
import pytest

from tests.helpers import RunningServer, embedded_model_dir, live_pids, wait_for

STREAMS = 3
# Streams must outlast the signal and the draining check even at 200 tokens/s a stream.
MAX_TOKENS = 512


def child_pid(srv: RunningServer, title: str) -> int:
    for pid in srv.child_pids():
        try:
            if psutil.Process(pid).cmdline()[0] == f"berth::{title}":
                return pid
        except (psutil.NoSuchProcess, IndexError):
            continue
    raise AssertionError(f"no berth::{title} child among {srv.child_pids()}")


def stream_chat(base_url: str, model: str, i: int, results: dict[int, dict]) -> None:
    """One streaming chat request; records its status, finish reason, token count and [DONE]."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Count from {i} upwards, slowly."}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out: dict = {"status": None, "finish": None, "done": False, "tokens": None, "error": None}
    try:
        with httpx.stream(
            "POST", f"{base_url}/v1/chat/completions", json=body, timeout=120
        ) as response:
            out["status"] = response.status_code
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    chunk = httpx.Response(200, content=line[6:]).json()
                    if chunk.get("usage"):
                        out["tokens"] = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", []):
                        out["finish"] = choice.get("finish_reason") or out["finish"]
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    results[i] = out


@pytest.mark.parametrize(
    ("sig", "target"),
    [
        (signal.SIGTERM, "group"),
        (signal.SIGTERM, "api"),
        (signal.SIGTERM, "scheduler"),
        (signal.SIGTERM, "detokenizer"),
        (signal.SIGINT, "group"),
        (signal.SIGINT, "scheduler"),
    ],
    ids=lambda v: v.name if isinstance(v, signal.Signals) else v,
)
def test_a_stop_signal_to_any_process_drains_every_stream_and_exits_0(
    sig: signal.Signals, target: str
) -> None:
    srv = RunningServer(
        "--model", embedded_model_dir(), "--graceful-shutdown-timeout", "60"
    ).wait_ready()
    try:
        children = srv.child_pids()
        model = httpx.get(f"{srv.base_url}/v1/models").json()["data"][0]["id"]
        results: dict[int, dict] = {}
        threads = [
            threading.Thread(target=stream_chat, args=(srv.base_url, model, i, results))
            for i in range(STREAMS)
        ]
        for t in threads:
            t.start()
        wait_for(
            lambda: httpx.get(f"{srv.base_url}/get_load").json().get("num_running_reqs") == STREAMS,
            30,
            what="the streams to run",
        )
        if target == "group":
            os.killpg(srv.proc.pid, sig)
        elif target == "api":
            srv.proc.send_signal(sig)
        else:
            os.kill(child_pid(srv, target), sig)

        wait_for(
            lambda: httpx.get(f"{srv.base_url}/health").status_code == 503, 10, what="draining"
        )
        assert httpx.get(f"{srv.base_url}/health").json()["status"] == "draining"
        for t in threads:
            t.join(120)
        for i in range(STREAMS):
            assert results[i] == {
                "status": 200,
                "finish": "length",
                "done": True,
                "tokens": MAX_TOKENS,
                "error": None,
            }, (i, results[i])
        assert srv.proc.wait(60) == 0
        wait_for(lambda: not live_pids(children), 10, what="the children to exit")
    finally:
        srv.stop()
