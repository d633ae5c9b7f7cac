"""Engine behaviour with the real model: prefix reuse, chunked prefill, retraction, queue limits."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers import RunningServer, embedded_model_dir, embedded_tokenizer

LONG_PROMPT = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(40))


def generate(base_url: str, **body) -> httpx.Response:
    return httpx.post(f"{base_url}/generate", json=body, timeout=300)


def greedy(n: int, **extra) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **extra}


@pytest.fixture(scope="module")
def tight() -> Iterator[RunningServer]:
    """A server with small chunks, a small KV pool and short queues."""
    srv = RunningServer(
        "--model",
        embedded_model_dir(),
        "--dtype",
        "float32",
        "--chunked-prefill-size",
        "64",
        "--max-total-tokens",
        "600",
        "--max-running-requests",
        "6",
        "--max-queued-requests",
        "4",
    ).wait_ready()
    yield srv
    srv.stop()


def test_repeated_prefix_reports_cached_tokens_with_identical_output(server, client):
    messages = [
        {"role": "system", "content": LONG_PROMPT},
        {"role": "user", "content": "Which color is item 7?"},
    ]
    kwargs = {"model": "smollm2-135m-instruct", "messages": messages, "temperature": 0}
    first = client.chat.completions.create(**kwargs, max_tokens=16)
    second = client.chat.completions.create(**kwargs, max_tokens=16)
    assert second.choices[0].message.content == first.choices[0].message.content
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= second.usage.prompt_tokens - 1 > 300
    # A different question after the same long system prompt still reuses the shared part.
    messages[1]["content"] = "How many boxes are blue?"
    third = client.chat.completions.create(**{**kwargs, "messages": messages}, max_tokens=4)
    assert 300 < third.usage.prompt_tokens_details.cached_tokens < third.usage.prompt_tokens


def test_chunked_prefill_gives_the_same_output(server, tight):
    ids = embedded_tokenizer()(LONG_PROMPT).input_ids
    assert len(ids) > 4 * 64, "the prompt must span several chunks"
    body = {"input_ids": ids, "sampling_params": greedy(24)}
    whole = generate(server.base_url, **body).json()
    chunked = generate(tight.base_url, **body).json()
    assert chunked["output_ids"] == whole["output_ids"]


def test_small_kv_pool_completes_every_request_through_retraction(server, tight):
    prompts = [f"Tell me about the number {i}." for i in range(6)]
    alone = [generate(server.base_url, text=p, sampling_params=greedy(120)).json() for p in prompts]
    with ThreadPoolExecutor(6) as pool:
        together = list(
            pool.map(
                lambda p: generate(tight.base_url, text=p, sampling_params=greedy(120)), prompts
            )
        )
    assert all(r.status_code == 200 for r in together), [r.text for r in together]
    assert [r.json()["output_ids"] for r in together] == [a["output_ids"] for a in alone]
    assert "retracted" in tight.output(), "6 x 130 tokens cannot fit in 600: expected retraction"


def test_request_that_can_never_fit_is_rejected_up_front(tight):
    resp = generate(tight.base_url, text="hi", sampling_params={"max_new_tokens": 700})
    assert resp.status_code == 400
    assert "KV cache" in resp.json()["error"]["message"]


def test_full_queue_is_503_with_retry_after_and_accepted_requests_complete(tight):
    body = {"text": "Count to ten.", "sampling_params": greedy(40)}
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: generate(tight.base_url, **body), range(16)))
    rejected = [r for r in results if r.status_code == 503]
    accepted = [r for r in results if r.status_code == 200]
    assert rejected, "16 requests > 6 running + 4 queued: some must be refused"
    assert len(accepted) + len(rejected) == 16
    for r in rejected:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["message"]
    assert all(r.json()["meta_info"]["completion_tokens"] == 40 for r in accepted)
