"""--enable-deterministic-inference: a greedy request answers the same, token for token, alone
or among fifteen others, on a real server. So do the defaults where Berth's int8 kernel runs
(every decode step on the 4-bit weights); with PyTorch's int4 kernel, decode steps of up to eight
sequences run on the 4-bit weights and larger ones on bf16, so answers can change with load."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers import RunningServer
from tests.integration.runtime.chat_prompts import QUESTIONS, SYSTEM_PROMPT

CONCURRENT = 16
TOKENS = 40


@pytest.fixture(scope="module", params=["deterministic", "defaults"])
def server(request) -> Iterator[RunningServer]:
    flags = ["--enable-deterministic-inference"] if request.param == "deterministic" else []
    srv = RunningServer(*flags).wait_ready()
    try:
        engine = httpx.get(f"{srv.base_url}/get_server_info").json()["engine"]
        if not flags and engine["q4_kernel"] != "berth_int8":
            pytest.skip("the defaults are batch-invariant only with Berth's int8 kernel")
        yield srv
    finally:
        srv.stop()


def answer(base_url: str, question: str) -> list[bytes]:
    """The greedy answer, token by token (each token's bytes, from the chat logprobs)."""
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": question},
        ],
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
    }
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == TOKENS
    return [bytes(t["bytes"]) for t in content]


def test_the_mode_is_on_and_uses_one_weight_format(server: RunningServer):
    info = httpx.get(f"{server.base_url}/get_server_info").json()
    engine = info["engine"]
    assert (
        engine["deterministic_inference"] is (info["server_args"]["enable_deterministic_inference"])
    )
    assert engine["attention_backend"] == "berth_cpu"
    assert engine["max_running_requests"] >= CONCURRENT
    if engine["q4_weight_bytes"]:  # bf16 here: every decode step, any size, on the 4-bit weights
        assert engine["gguf_q4_max_batch"] == engine["max_running_requests"]
    else:  # fp32 (a CPU without native bf16): no 4-bit path, one format anyway
        assert engine["gguf_q4_max_batch"] == 0


def test_sixteen_concurrent_greedy_answers_equal_their_solo_answers(server: RunningServer):
    questions = QUESTIONS[:CONCURRENT]
    solo = [answer(server.base_url, q) for q in questions]
    with ThreadPoolExecutor(CONCURRENT) as pool:
        together = list(pool.map(lambda q: answer(server.base_url, q), questions))
    same = sum(a == b for a, b in zip(solo, together))
    assert same == CONCURRENT, f"{same}/{CONCURRENT} equal their solo answers"
