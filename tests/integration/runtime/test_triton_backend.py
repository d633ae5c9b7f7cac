"""`--attention-backend triton` end to end: a real `berth serve` whose attention runs Berth's
Triton paged kernels. On CPU they run through Triton's interpreter (TRITON_INTERPRET=1), which is
how CI exercises the GPU's attention path, prefill and decode, without a GPU; without the
interpreter a CPU server refuses the backend in one line."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from berth_common.cli import berth_command
from tests.helpers import RunningServer
from tests.integration.runtime.chat_prompts import messages

MODEL = "smollm2-135m-instruct"

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    env = {"TRITON_INTERPRET": "1"}
    args = ("--attention-backend", "triton", "--device", "cpu", "--max-total-tokens", "2048")
    srv = RunningServer(*args, env=env)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def chat(base_url: str, question: str, max_tokens: int, system: str | None = None) -> str:
    body = {
        "model": MODEL,
        "messages": messages(question, system),
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_the_server_runs_triton_attention(server):
    info = httpx.get(f"{server.base_url}/get_server_info", timeout=10).json()
    assert info["engine"]["attention_backend"] == "triton"
    assert info["engine"]["cuda_graph_max_bs"] == 0  # graphs are for CUDA
    assert info["engine"]["overlap_schedule"] is False  # and so is overlap, which needs them


def test_the_quick_start_question_gets_the_readme_answer(server):
    """The README's request (no system prompt), greedy."""
    assert chat(server.base_url, "What is the capital of France?", 16) == (
        "The capital of France is Paris."
    )


def test_concurrent_requests_answer_as_each_alone(server):
    """Batched prefills and decode steps through the kernels give each request its solo text."""
    questions = ["What is 17 times 3?", "Name three primary colors."]
    alone = [chat(server.base_url, q, 6) for q in questions]
    with ThreadPoolExecutor(len(questions)) as pool:
        together = list(pool.map(lambda q: chat(server.base_url, q, 6), questions))
    assert together == alone
    assert all(alone)


def test_on_cpu_without_the_interpreter_it_is_a_one_line_error():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        berth_command("serve", "--attention-backend", "triton", "--device", "cpu"),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "berth serve: error: --attention-backend triton runs on CUDA; on CPU tensors only under "
        "Triton's interpreter (TRITON_INTERPRET=1, for tests)"
    )
