"""Fuzzing the request parsers: whatever JSON arrives, the answer is a 200 or a 4xx OpenAI error,
never an exception (hypothesis, derandomized so that every run tries the same bodies)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from berth_common.errors import RequestError
from berth_runtime.entrypoints.serving_generate import GENERATE_FIELDS, parse_generate
from tests.unit.runtime.fakes import MODEL, FakeTokenizerManager, build_app, load_tokenizer

CHAT_FIELDS = [
    "messages", "model", "n", "temperature", "top_p", "top_k", "min_p", "logit_bias", "seed",
    "stop", "stop_token_ids", "min_tokens", "max_tokens", "max_completion_tokens", "logprobs",
    "top_logprobs", "stream", "stream_options", "rid", "routed_dp_rank", "priority", "tools",
    "response_format", "user", "ignore_eos",
]  # fmt: skip
COMPLETION_FIELDS = [f for f in CHAT_FIELDS if f not in ("messages", "top_logprobs")] + [
    "prompt",
    "echo",
    "best_of",
    "suffix",
]
SAMPLING_FIELDS = ["max_new_tokens", "temperature", "top_k", "stop", "seed", "logit_bias"]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "robot"]), "content": json_values}
    ),
    max_size=3,
)


def bodies(fields: list[str], valid: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A sometimes-valid base with fuzzed known and unknown fields on top."""
    fuzzed = st.dictionaries(st.sampled_from(fields) | st.text(max_size=6), json_values, max_size=5)
    base = st.sampled_from([{}, valid])
    return st.builds(lambda b, f: {**b, **f}, base, fuzzed)


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(build_app(FakeTokenizerManager(load_tokenizer())))


FUZZ = settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def assert_answered(response: Any) -> None:
    assert response.status_code in (200, 400, 404), response.text
    if response.status_code != 200:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@FUZZ
@given(
    body=bodies(CHAT_FIELDS, {"messages": [{"role": "user", "content": "hi"}], "model": MODEL})
    | st.builds(lambda m: {"messages": m}, messages)
)
def test_chat_bodies(client: TestClient, body: dict[str, Any]) -> None:
    assert_answered(client.post("/v1/chat/completions", json=body))


@FUZZ
@given(body=bodies(COMPLETION_FIELDS, {"prompt": "hi", "model": MODEL}))
def test_completion_bodies(client: TestClient, body: dict[str, Any]) -> None:
    assert_answered(client.post("/v1/completions", json=body))


@FUZZ
@given(
    body=bodies(sorted(GENERATE_FIELDS), {"text": "hi"}),
    params=st.dictionaries(st.sampled_from(SAMPLING_FIELDS), json_values, max_size=3),
)
def test_generate_bodies(body: dict[str, Any], params: dict[str, Any]) -> None:
    if params and "sampling_params" not in body:
        body["sampling_params"] = params
    try:
        objs, _ = parse_generate(body)
    except RequestError as e:
        assert e.status_code == 400 and e.message
    else:
        assert objs and all(o.text is not None or o.input_ids for o in objs)
