"""Priority scheduling with the real model: a high-priority request preempts a running
low-priority one, which resumes later with exactly the output it would have had alone."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers import RunningServer, embedded_model_dir, wait_for

LOW_TOKENS = 200
HIGH_TOKENS = 16


def greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def one_slot() -> Iterator[RunningServer]:
    """Priority scheduling with room for a single running request."""
    srv = RunningServer(
        "--model",
        embedded_model_dir(),
        "--dtype",
        "float32",
        "--schedule-policy",
        "priority",
        "--max-running-requests",
        "1",
        "--log-level",
        "info",
    ).wait_ready()
    yield srv
    srv.stop()


def test_high_priority_preempts_and_the_low_priority_stream_resumes_intact(one_slot):
    low_body = {
        "text": "Write a long story about a lighthouse.",
        "sampling_params": greedy(LOW_TOKENS),
    }
    alone = httpx.post(f"{one_slot.base_url}/generate", json=low_body, timeout=300).json()
    assert len(alone["output_ids"]) == LOW_TOKENS

    events: list[dict] = []
    finished: dict[str, float] = {}

    def stream_low() -> None:
        body = {**low_body, "stream": True, "priority": 0}
        with httpx.stream("POST", f"{one_slot.base_url}/generate", json=body, timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        finished["low"] = time.monotonic()

    low = threading.Thread(target=stream_low)
    low.start()
    try:
        wait_for(
            lambda: bool(events) and len(events[-1]["output_ids"]) >= 8,
            60,
            what="the low-priority stream to be decoding",
        )
        high_body = {
            "text": "The capital of France is",
            "sampling_params": greedy(HIGH_TOKENS),
            "priority": 10,
        }
        high = httpx.post(f"{one_slot.base_url}/generate", json=high_body, timeout=300)
        finished["high"] = time.monotonic()
    finally:
        low.join(300)
    assert high.status_code == 200, high.text
    assert len(high.json()["output_ids"]) == HIGH_TOKENS
    assert "low" in finished and finished["high"] < finished["low"]
    assert "preempted" in one_slot.output()

    # The stream only grew (nothing lost or repeated) and ends with the output it has alone.
    ids = [e["output_ids"] for e in events]
    assert all(b[: len(a)] == a for a, b in zip(ids, ids[1:]))
    assert ids[-1] == alone["output_ids"]
    assert events[-1]["text"] == alone["text"]
