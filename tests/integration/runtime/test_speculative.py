"""--speculative-algorithm ngram on real servers: every greedy answer equals plain decoding's,
token for token (rewrites, where drafts are accepted, and chat, where they mostly are not), with
max_tokens, stop strings, streaming, logprobs and concurrent requests; the acceptance counters
move in /metrics."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers import RunningServer, wait_for

MODEL = "smollm2-135m-instruct"
SNIPPET = """def load_config(path):
    with open(path) as f:
        data = json.load(f)
    for field in ("name", "version", "owner"):
        if field not in data:
            raise ValueError(f"missing field: {field}")
    data.setdefault("retries", 3)
    return data


def save_config(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
"""
REWRITE = (
    "Repeat the following code exactly, but rename load_config to read_config.\n\n"
    f"```python\n{SNIPPET}```"
)
PROMPTS = [REWRITE, "What is the capital of France?", "Write a haiku about ships."]


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, RunningServer]]:
    both = {
        "plain": RunningServer(),
        "ngram": RunningServer("--speculative-algorithm", "ngram"),
    }
    try:
        yield {name: srv.wait_ready() for name, srv in both.items()}
    finally:
        for srv in both.values():
            srv.stop()


def chat(srv: RunningServer, prompt: str, **fields) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": 160,
        **fields,
    }
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def counters(srv: RunningServer) -> tuple[float, float]:
    text = httpx.get(f"{srv.base_url}/metrics").text
    found = [
        float(re.search(rf"^berth:spec_decode_num_{name}_tokens{{[^}}]*}} (\S+)$", text, re.M)[1])
        for name in ("draft", "accepted")
    ]
    return found[0], found[1]


def test_greedy_answers_equal_plain_decoding_and_drafts_are_accepted(servers):
    info = httpx.get(f"{servers['ngram'].base_url}/get_server_info").json()
    assert info["engine"]["speculative_algorithm"] == "ngram"
    before = counters(servers["ngram"])
    for prompt in PROMPTS:
        plain, ngram = chat(servers["plain"], prompt), chat(servers["ngram"], prompt)
        assert ngram["choices"][0]["message"] == plain["choices"][0]["message"], prompt
        assert ngram["usage"] == plain["usage"]
    drafted, accepted = (a - b for a, b in zip(counters(servers["ngram"]), before))
    # The rewrite repeats much of its prompt: many drafts hold (measured here: 32 of 66).
    assert drafted > 0 and accepted >= drafted / 4, (drafted, accepted)


def test_max_tokens_and_stop_strings_end_where_plain_decoding_ends(servers):
    for fields in ({"max_tokens": 37}, {"stop": ["setdefault"]}, {"stop": ["\n\n\n"]}):
        plain, ngram = (
            chat(servers["plain"], REWRITE, **fields),
            chat(servers["ngram"], REWRITE, **fields),
        )
        assert ngram["choices"][0] == plain["choices"][0], fields
        assert ngram["usage"] == plain["usage"], fields
    assert chat(servers["ngram"], REWRITE, max_tokens=37)["usage"]["completion_tokens"] == 37
    body = {
        "text": REWRITE,
        "sampling_params": {"max_new_tokens": 45, "temperature": 0, "ignore_eos": True},
    }
    outs = [
        httpx.post(f"{servers[k].base_url}/generate", json=body, timeout=300).json()
        for k in ("plain", "ngram")
    ]
    assert outs[1]["output_ids"] == outs[0]["output_ids"]
    assert len(outs[1]["output_ids"]) == 45


def test_streamed_answer_equals_the_plain_one(servers):
    plain = chat(servers["plain"], REWRITE)["choices"][0]["message"]["content"]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": REWRITE}],
        "temperature": 0,
        "max_tokens": 160,
        "stream": True,
    }
    pieces = []
    with httpx.stream(
        "POST", f"{servers['ngram'].base_url}/v1/chat/completions", json=body, timeout=300
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                pieces.append(delta.get("content") or "")
    assert "".join(pieces) == plain


def test_requests_it_does_not_apply_to_decode_as_before(servers):
    """Logprobs and a batch larger than --speculative-max-batch decode plainly: same answers."""
    plain = chat(servers["plain"], REWRITE, logprobs=True, max_tokens=40)
    ngram = chat(servers["ngram"], REWRITE, logprobs=True, max_tokens=40)
    assert ngram["choices"][0] == plain["choices"][0]

    def both(srv: RunningServer) -> list[str]:
        with ThreadPoolExecutor(2) as pool:
            outs = pool.map(lambda p: chat(srv, p, max_tokens=60), PROMPTS[:2])
        return [o["choices"][0]["message"]["content"] for o in outs]

    assert both(servers["ngram"]) == both(servers["plain"])


def test_no_kv_slot_is_lost_to_rejected_drafts(servers):
    """After the requests above (many drafts rejected) and a few more, the idle server holds no
    KV slot but what its prefix cache may evict: every rejected draft's slot went back."""
    for prompt in PROMPTS:
        chat(servers["ngram"], prompt, max_tokens=200)

    def used_tokens() -> float:
        text = httpx.get(f"{servers['ngram'].base_url}/metrics").text
        return float(re.search(r"^sglang:num_used_tokens\{[^}]*\} (\S+)$", text, re.M)[1])

    wait_for(lambda: used_tokens() == 0, 10, what="the KV pool to hold nothing but the cache")
