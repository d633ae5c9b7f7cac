"""Same question, same answer: a real `berth serve` at its defaults gives a greedy request the same
text whether its prompt was cached, partly cached, chunked or new; and the README's quick-start
request answers what the README shows, run after run."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest
import torch

from berth_runtime.model_executor.model_runner import cpu_has_native_bf16
from berth_runtime.models.gguf_q4 import can_run_int4
from berth_runtime.utils import cpu_isa
from tests.helpers import RunningServer
from tests.integration.runtime.chat_prompts import QUESTIONS, messages

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 40
README = Path(__file__).resolve().parents[3] / "README.md"
CHUNK = 8  # --chunked-prefill-size of the chunking test's server


def server_info(base_url: str) -> dict:
    response = httpx.get(f"{base_url}/get_server_info", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


# The defaults of this CPU and, where it has more than AVX2, those of an AVX2-only CPU
# (BERTH_CPU_ISA=avx2): whatever CPU runs the suite checks both.
CPUS = {"this CPU": {}}
if cpu_isa.isa_cap() is None and "avx512bw" in (cpu_isa.cpu_flags() or ()):
    CPUS["AVX2"] = {cpu_isa.ISA_ENV: "avx2"}


@pytest.fixture(scope="module", params=list(CPUS))
def cpu_env(request) -> dict[str, str]:
    return CPUS[request.param]


@pytest.fixture(scope="module")
def server(cpu_env: dict[str, str]) -> Iterator[RunningServer]:
    """`berth serve` with nothing but a port: the defaults a new user gets. With the 4-bit decode
    path live (wherever Berth's int8 kernel or PyTorch's int4 kernel runs), the prompt's prefill
    and the short steps after it run on different weights: bf16 and 4-bit on CPUs with native
    bf16, fp32 and 4-bit on others (AVX2)."""
    srv = RunningServer(env=cpu_env).wait_ready()
    try:
        engine = server_info(srv.base_url)["engine"]
        bf16 = not cpu_env and cpu_has_native_bf16()
        assert engine["dtype"] == ("bfloat16" if bf16 else "float32"), engine
        assert engine["attention_backend"] == "berth_cpu", engine
        x86 = "avx2" in (cpu_isa.cpu_flags() or ())  # Berth's int8 kernel runs
        if x86 or (bf16 and can_run_int4(torch.bfloat16, torch.device("cpu"))):
            assert engine["gguf_q4_max_batch"] > 0, engine
            assert engine["q4_weight_bytes"] > 0, engine  # the 4-bit weights are really loaded
        if cpu_env:
            assert engine["quant_isa"] == "avx2" and engine["cpu_capability"] == "AVX2", engine
    except BaseException:
        srv.stop()
        raise
    yield srv
    srv.stop()


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


class Answer(NamedTuple):
    text: str
    cached_tokens: int  # prompt tokens the server reports as cached
    prompt_tokens: int


def ask(http: httpx.Client, chat: list[dict[str, str]]) -> Answer:
    """A greedy answer (never empty) and its prompt's token counts."""
    response = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": chat, "temperature": 0, "max_tokens": MAX_TOKENS},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    text = body["choices"][0]["message"]["content"]
    assert text and text.strip(), body
    details = body["usage"].get("prompt_tokens_details") or {}
    return Answer(text, details.get("cached_tokens", 0), body["usage"]["prompt_tokens"])


def flush(http: httpx.Client) -> None:
    assert http.post("/flush_cache").json()["success"]


def test_answer_does_not_depend_on_the_prefix_cache(http):
    """Each question: cold, again with its whole prompt cached, and after another question that
    shares its system prompt (only that part cached). 22 questions, every text equal."""
    differing = []
    for i, question in enumerate(QUESTIONS):
        flush(http)
        cold, cold_cached, _ = ask(http, messages(question))
        again, again_cached, _ = ask(http, messages(question))
        flush(http)
        ask(http, messages(QUESTIONS[(i + 1) % len(QUESTIONS)]))
        shared, shared_cached, _ = ask(http, messages(question))
        # The cache really served the second and third requests.
        assert cold_cached == 0 and again_cached > shared_cached > 0, (
            cold_cached,
            again_cached,
            shared_cached,
        )
        if not cold == again == shared:
            differing.append((question, cold, again, shared))
    assert not differing, differing


def test_next_turn_does_not_depend_on_the_previous_turn_being_cached(http):
    """A conversation's second turn, sent right after the first (whose prompt, and whatever of
    its answer the cache keeps, is reused) and again cold, gives the same text."""
    differing = []
    for first, second in zip(QUESTIONS[:5], QUESTIONS[5:10]):
        flush(http)
        answer = ask(http, messages(first)).text
        turn = [
            *messages(first),
            {"role": "assistant", "content": answer},
            {"role": "user", "content": second},
        ]
        warm, warm_cached, _ = ask(http, turn)
        flush(http)
        cold = ask(http, turn).text
        assert warm_cached > 0
        if warm != cold:
            differing.append((first, second, warm, cold))
    assert not differing, differing


def test_answer_does_not_depend_on_prefill_chunking(http, cpu_env):
    """A server that prefills in chunks of 8 tokens answers every question as the default
    (512-token chunks: these prompts in one step) does."""
    expected = {}
    for question in QUESTIONS:
        flush(http)
        expected[question] = ask(http, messages(question)).text
    chunked = RunningServer("--chunked-prefill-size", str(CHUNK), env=cpu_env).wait_ready()
    try:
        assert server_info(chunked.base_url)["server_args"]["chunked_prefill_size"] == CHUNK
        with httpx.Client(base_url=chunked.base_url, timeout=120) as other:
            answers = {}
            for question in QUESTIONS:
                flush(other)  # the whole prompt prefilled, not only what follows a cached part
                answers[question] = ask(other, messages(question))
    finally:
        chunked.stop()
    # Every prompt really was prefilled in several chunks, none of it from the cache.
    assert all(a.prompt_tokens > 2 * CHUNK and a.cached_tokens == 0 for a in answers.values()), {
        q: a.prompt_tokens for q, a in answers.items()
    }
    assert {question: a.text for question, a in answers.items()} == expected


def readme_quick_start() -> tuple[dict, str]:
    """The README's quick-start chat request body and the answer it shows."""
    text = README.read_text()
    section = text[text.index("## Quick start") :]
    body = re.search(r"-d '(\{.*?\})'", section, re.S)
    shown = re.search(r'"content": "([^"]*)"', section[body.end() :])
    assert body and shown, "the README's quick start has a curl request and its answer"
    return json.loads(body.group(1)), shown.group(1)


def test_readme_quick_start_answers_what_the_readme_shows(http):
    body, shown = readme_quick_start()
    assert body.get("max_tokens"), "a looping answer must not run to the end of the context"
    assert body["temperature"] == 0
    flush(http)
    for _ in range(3):  # cold, then cached
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["message"]["content"] == shown
        assert choice["finish_reason"] == "stop"  # the whole answer, as the README shows


def test_readme_quick_start_python_example_caps_its_answer():
    text = README.read_text()
    section = text[text.index("## Quick start") : text.index("## `berth serve`")]
    calls = [b for b in re.findall(r"```python\n(.*?)```", section, re.S) if ".create(" in b]
    assert calls, "the README's quick start has a Python example"
    assert all("max_tokens=" in call for call in calls), calls
