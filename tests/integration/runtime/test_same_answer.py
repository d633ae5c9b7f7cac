"""Same question, same answer: a real `berth serve` at its defaults gives a greedy request the same
text whether its prompt was cached, partly cached, chunked or new; and the README's quick-start
request answers what the README shows, run after run."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import RunningServer
from tests.integration.runtime.chat_prompts import QUESTIONS, messages

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 40
README = Path(__file__).resolve().parents[3] / "README.md"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    """`berth serve` with nothing but a port: the defaults a new user gets."""
    srv = RunningServer().wait_ready()
    yield srv
    srv.stop()


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def ask(http: httpx.Client, chat: list[dict[str, str]]) -> tuple[str, int]:
    """Greedy answer and the prompt tokens the server reports as cached."""
    response = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": chat, "temperature": 0, "max_tokens": MAX_TOKENS},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    details = body["usage"].get("prompt_tokens_details") or {}
    return body["choices"][0]["message"]["content"], details.get("cached_tokens", 0)


def flush(http: httpx.Client) -> None:
    assert http.post("/flush_cache").json()["success"]


def test_answer_does_not_depend_on_the_prefix_cache(http):
    """Each question: cold, again with its whole prompt cached, and after another question that
    shares its system prompt (only that part cached). 22 questions, every text equal."""
    differing = []
    for i, question in enumerate(QUESTIONS):
        flush(http)
        cold, cold_cached = ask(http, messages(question))
        again, again_cached = ask(http, messages(question))
        flush(http)
        ask(http, messages(QUESTIONS[(i + 1) % len(QUESTIONS)]))
        shared, shared_cached = ask(http, messages(question))
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
        answer, _ = ask(http, messages(first))
        turn = [
            *messages(first),
            {"role": "assistant", "content": answer},
            {"role": "user", "content": second},
        ]
        warm, warm_cached = ask(http, turn)
        flush(http)
        cold, _ = ask(http, turn)
        assert warm_cached > 0
        if warm != cold:
            differing.append((first, second, warm, cold))
    assert not differing, differing


def test_answer_does_not_depend_on_prefill_chunking(http):
    """A server that prefills in chunks of 8 tokens answers every question as the default
    (512-token chunks: these prompts in one step) does."""
    expected = {}
    for question in QUESTIONS:
        flush(http)
        expected[question] = ask(http, messages(question))[0]
    chunked = RunningServer("--chunked-prefill-size", "8").wait_ready()
    try:
        with httpx.Client(base_url=chunked.base_url, timeout=120) as other:
            got = {question: ask(other, messages(question))[0] for question in QUESTIONS}
    finally:
        chunked.stop()
    assert got == expected


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
        assert response.json()["choices"][0]["message"]["content"] == shown
