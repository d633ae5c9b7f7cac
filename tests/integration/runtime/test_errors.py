"""Bad input gets an OpenAI-style error with the right status, and never hurts the server."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.helpers import wait_for
from tests.integration.runtime.conftest import MODEL

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["object"] == "error"
    assert {"message", "type", "param", "code"} <= set(body)
    assert body["message"]
    if param is not None:
        assert body["param"] == param, body
    return body


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": "hello"}, "messages"),
    ],
)
def test_invalid_fields_are_400(http: httpx.Client, payload, param):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **payload}
    err = assert_error(http.post(CHAT, json=body), 400)
    assert param in (err["param"] or "") or param in err["message"], err


def test_unknown_model_is_404(http: httpx.Client):
    resp = http.post(CHAT, json={"model": "gpt-4", "messages": MESSAGES})
    assert assert_error(resp, 404, "model")["code"] == "model_not_found"


def test_malformed_json_is_400(http: httpx.Client):
    resp = http.post(CHAT, content=b"{not json", headers={"content-type": "application/json"})
    assert_error(resp, 400)
    assert_error(http.post("/generate", content=b"[1,2"), 400)


def test_prompt_longer_than_context_is_400(http: httpx.Client):
    long_prompt = "hello " * 9000
    err = assert_error(
        http.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt}), 400
    )
    assert "context length" in err["message"]
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 9000})
    assert "context length" in assert_error(resp, 400)["message"]


def test_token_ids_outside_vocab_are_400(http: httpx.Client):
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 10**7]}), 400)
    assert_error(http.post("/generate", json={"input_ids": [-1]}), 400)


def test_native_generate_rejects_unknown_sampling_params(http: httpx.Client):
    resp = http.post("/generate", json={"text": "hi", "sampling_params": {"temprature": 0}})
    assert "temprature" in assert_error(resp, 400, "sampling_params")["message"]
    assert_error(http.post("/generate", json={"sampling_params": {}}), 400)


def test_duplicate_in_flight_rid_is_400(http: httpx.Client, server):
    rid = "dup-rid-test"
    body = {
        "text": "Tell me a story.",
        "rid": rid,
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
    }
    result: dict = {}
    first = threading.Thread(
        target=lambda: result.update(
            r=httpx.post(f"{server.base_url}/generate", json=body, timeout=120)
        )
    )
    first.start()
    try:
        wait_for(
            lambda: http.get("/get_load").json()["num_inflight_requests"] >= 1,
            30,
            what="first request",
        )
        assert (
            "already running"
            in assert_error(http.post("/generate", json=body), 400, "rid")["message"]
        )
    finally:
        http.post("/abort_request", json={"rid": rid})
        first.join(60)
    assert result["r"].status_code == 499


def test_server_still_serves_after_bad_input(http: httpx.Client):
    resp = http.post(
        CHAT, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    )
    assert resp.status_code == 200
    assert resp.json()["usage"]["completion_tokens"] <= 3
