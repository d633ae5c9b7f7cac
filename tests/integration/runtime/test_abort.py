"""Disconnects and /abort_request free the request in the scheduler: nothing decodes for nobody."""

from __future__ import annotations

import threading

import httpx

from tests.helpers import wait_for

LONG = {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}


def running(http: httpx.Client) -> int:
    load = http.get("/get_load").json()
    return load["num_running_reqs"] + load["num_waiting_reqs"]


def idle(http: httpx.Client) -> bool:
    return running(http) == 0 and http.get("/get_load").json()["num_inflight_requests"] == 0


def test_stream_disconnect_aborts(server, http: httpx.Client):
    wait_for(lambda: idle(http), 30, what="an idle server")
    body = {
        "model": "smollm2-135m-instruct",
        "prompt": "Write a long essay.",
        "max_tokens": 2000,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(base_url=server.base_url, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=body) as resp,
    ):
        lines = resp.iter_lines()
        for _ in range(5):
            next(lines)
        wait_for(lambda: running(http) == 1, 10, what="the stream to be running")  # heartbeat lag
    # The connection is closed: the scheduler must drop the request quickly.
    wait_for(lambda: idle(http), 10, what="the disconnected request to be aborted")


def test_non_stream_disconnect_aborts(server, http: httpx.Client):
    wait_for(lambda: idle(http), 30, what="an idle server")
    body = {"text": "Write a long essay.", "sampling_params": LONG}
    try:
        httpx.post(f"{server.base_url}/generate", json=body, timeout=2.0)
    except httpx.ReadTimeout:
        pass  # the client gave up and closed the connection
    wait_for(lambda: idle(http), 15, what="the abandoned request to be aborted")


def test_abort_request_by_rid(server, http: httpx.Client):
    wait_for(lambda: idle(http), 30, what="an idle server")
    result: dict = {}
    body = {"text": "Write a long essay.", "rid": "abort-me", "sampling_params": LONG}
    t = threading.Thread(
        target=lambda: result.update(
            r=httpx.post(f"{server.base_url}/generate", json=body, timeout=120)
        )
    )
    t.start()
    wait_for(lambda: running(http) == 1, 30, what="the request to start")
    assert http.post("/abort_request", json={"rid": "abort-me"}).json() == {"success": True}
    t.join(30)
    assert result["r"].status_code == 499
    assert result["r"].json()["error"]["message"]
    wait_for(lambda: idle(http), 10, what="the aborted request to be freed")
    assert http.post("/abort_request", json={"rid": "no-such-rid"}).status_code == 404
