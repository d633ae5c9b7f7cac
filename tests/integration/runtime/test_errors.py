"""Bad input gets an OpenAI-style error with the right status, and never hurts the server."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.helpers import wait_for
from tests.integration.runtime.conftest import MODEL

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    assert set(resp.json()) == {"error"}, resp.json()
    body = resp.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
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
    err = assert_error(resp, 400)
    assert err["message"].startswith("the request body is not valid JSON: "), err
    assert "line 1, column 2" in err["message"]
    assert_error(http.post("/generate", content=b"[1,2"), 400)
    err = assert_error(http.post(CHAT, headers={"content-type": "application/json"}), 400)
    assert err["message"] == "the request has no body: send a JSON object"


def test_json_without_a_json_content_type_is_read_as_json(http: httpx.Client):
    """What `curl -d '{...}'` sends, without `-H 'Content-Type: application/json'`."""
    form = {"content-type": "application/x-www-form-urlencoded"}
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    for path, payload in ((CHAT, body), ("/v1/completions", {**body, "prompt": "hi"})):
        payload = {k: v for k, v in payload.items() if path == CHAT or k != "messages"}
        resp = http.post(path, content=json.dumps(payload).encode(), headers=form)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 2
    err = assert_error(http.post(CHAT, content=b"model=x", headers=form), 400)
    assert "not valid JSON" in err["message"]


def test_prompt_longer_than_context_is_400(http: httpx.Client):
    long_prompt = "hello " * 9000
    err = assert_error(
        http.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt}), 400
    )
    assert "context length" in err["message"]
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 9000})
    assert "context length" in assert_error(resp, 400)["message"]


def test_a_prompt_that_cannot_fit_says_context_length_exceeded(http: httpx.Client):
    # Too many tokens (tokenized and counted), and too many characters to tokenize at all.
    for prompt in ("hello " * 9000, "x" * 2_000_000):
        for path, body in (
            ("/v1/completions", {"model": MODEL, "prompt": prompt}),
            (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}),
        ):
            err = assert_error(http.post(path, json=body), 400)
            assert err["code"] == "context_length_exceeded", err
            assert "maximum context length" in err["message"]


RAW = {"content-type": "application/json"}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # Lone UTF-16 surrogates: valid JSON, but not Unicode any tokenizer can take.
        (
            CHAT,
            '{"model":"m","messages":[{"role":"user","content":"a\\ud800b"}]}',
            "messages.0.content",
        ),
        ("/v1/completions", '{"model":"m","prompt":"\\udfff"}', "prompt"),
        (
            CHAT,
            '{"model":"m","messages":[{"role":"user","content":"hi"}],"stop":["\\ud800"]}',
            "stop.0",
        ),
        (CHAT, '{"model":"\\ud800","messages":[{"role":"user","content":"hi"}]}', "model"),
        # Integers beyond 64 bits.
        (
            CHAT,
            '{"model":"m","messages":[{"role":"user","content":"hi"}],"priority":'
            + str(2**70)
            + "}",
            "priority",
        ),
        ("/v1/completions", '{"model":"m","prompt":"hi","top_k":' + str(2**64) + "}", "top_k"),
        ("/generate", '{"text":"hi","routed_dp_rank":' + str(-(2**64)) + "}", "routed_dp_rank"),
        # Nesting far past any real request (Python's parser would recurse until it fails).
        (CHAT, "[" * 100_000 + "]" * 100_000, None),
        ("/generate", '{"text":' + "[" * 200 + "]" * 200 + "}", None),
    ],
    ids=[
        "surrogate-content",
        "surrogate-prompt",
        "surrogate-stop",
        "surrogate-model",
        "huge-priority",
        "huge-top_k",
        "huge-negative-rank",
        "nested-100000",
        "nested-200",
    ],
)
def test_hostile_json_is_a_400_naming_the_field(http: httpx.Client, path, body, param):
    err = assert_error(http.post(path, content=body.encode(), headers=RAW), 400, param)
    assert "Traceback" not in err["message"]


def test_invalid_utf8_unknown_routes_and_wrong_methods_are_openai_errors(http: httpx.Client):
    assert_error(http.post(CHAT, content=b'{"model": "\xff\xfe"}', headers=RAW), 400)
    assert assert_error(http.get("/v1/nothing"), 404)["code"] == "not_found"
    assert assert_error(http.get(CHAT), 405)["code"] == "method_not_allowed"
    assert assert_error(http.delete("/generate"), 405)["code"] == "method_not_allowed"


def test_a_body_over_the_limit_is_413_before_it_is_read(http: httpx.Client):
    limit = 4 * 2**20  # the default for this model's 8k context: at least 4 MiB
    assert http.get("/get_server_info").json()["max_request_body_bytes"] == limit
    big = b'{"model":"m","prompt":"' + b"x" * limit + b'"}'
    err = assert_error(http.post("/v1/completions", content=big, headers=RAW), 413)
    assert err["code"] == "request_too_large" and str(limit) in err["message"]

    # Without a Content-Length (chunked), refused once the bytes received pass the limit.
    def chunks():
        yield b'{"model":"m","prompt":"'
        for _ in range(limit // 2**16 + 2):
            yield b"y" * 2**16
        yield b'"}'

    err = assert_error(http.post("/v1/completions", content=chunks(), headers=RAW), 413)
    assert err["code"] == "request_too_large"


def test_limits_the_engine_could_not_honour_are_400(http: httpx.Client):
    chat = {"model": MODEL, "messages": MESSAGES}
    assert_error(http.post(CHAT, json={**chat, "min_tokens": 2**63 - 1}), 400, "min_tokens")
    for start in (-5, 10**6):
        body = {"text": "hi", "return_logprob": True, "logprob_start_len": start}
        assert_error(http.post("/generate", json=body), 400, "logprob_start_len")
    # A string is not a boolean: "false" must not abort every request.
    assert_error(http.post("/abort_request", json={"abort_all": "false"}), 400, "abort_all")
    assert_error(http.post("/abort_request", json={"rid": 7}), 400, "rid")


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
