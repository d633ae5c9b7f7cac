"""/v1/completions over a scripted TokenizerManager: prompts, n, echo, legacy logprobs, SSE."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from transformers import PreTrainedTokenizerBase

from berth_runtime.io_struct import FinishReason
from berth_runtime.sampling_params import SamplingParams
from tests.unit.runtime.fakes import (
    MODEL,
    REPLY,
    FakeTokenizerManager,
    build_app,
    disconnect_after_first_chunk,
    sse_events,
)

PROMPT = "The capital of France is"


async def complete(http: httpx.AsyncClient, **fields: Any) -> httpx.Response:
    return await http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, **fields})


async def test_a_text_prompt_and_the_default_budget(
    http: httpx.AsyncClient, tm: FakeTokenizerManager
) -> None:
    response = await complete(http, temperature=0.3, stop="\n", logit_bias={"5": 1})
    assert response.status_code == 200, response.text
    body = response.json()
    [obj] = tm.received
    assert (obj.text, obj.input_ids, obj.return_logprob, obj.logprob_start_len) == (
        PROMPT,
        None,
        False,
        -1,
    )
    assert obj.sampling_params == SamplingParams(
        max_new_tokens=16, temperature=0.3, stop=["\n"], logit_bias={5: 1.0}
    )
    assert body["id"] == f"cmpl-{obj.rid}" and body["object"] == "text_completion"
    assert body["choices"] == [
        {"index": 0, "text": REPLY, "logprobs": None, "finish_reason": "stop"}
    ]
    prompt_tokens = len(tm.tokenizer(PROMPT).input_ids)
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["total_tokens"] == prompt_tokens + len(tm.tokenizer.encode(REPLY))


async def test_list_prompts_times_n_are_choices_in_order(
    http: httpx.AsyncClient, tm: FakeTokenizerManager
) -> None:
    tm.reply = lambda obj: f" {obj.text} / {obj.sampling_params.seed}"
    tm.cached_tokens = lambda obj: int(obj.rid.split("-")[-1])
    body = (await complete(http, prompt=["A", "B"], n=2, seed=10, rid="batch")).json()
    assert [obj.rid for obj in tm.received] == ["batch-0", "batch-1", "batch-2", "batch-3"]
    assert [c["text"] for c in body["choices"]] == [" A / 10", " A / 11", " B / 10", " B / 11"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    prompt_tokens = len(tm.tokenizer("A").input_ids) + len(tm.tokenizer("B").input_ids)
    assert body["usage"]["prompt_tokens"] == prompt_tokens  # each prompt once
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0 + 2}


async def test_sequences_per_request_are_capped_before_any_work(
    http: httpx.AsyncClient, tm: FakeTokenizerManager
) -> None:
    tm.max_sequences_per_request = 6
    refused = await complete(http, prompt=["A", "B", "C", "D"], n=2)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (
        error["param"] == "n"
        and "8 sequences" in error["message"]
        and "at most 6" in error["message"]
    )
    assert tm.received == []
    allowed = await complete(http, prompt=["A", "B", "C"], n=2)
    assert allowed.status_code == 200 and len(allowed.json()["choices"]) == 6


@pytest.mark.parametrize(
    ("prompt", "input_ids"), [([5, 6, 7], [[5, 6, 7]]), ([[5, 6], [7]], [[5, 6], [7]])]
)
async def test_token_id_prompts(
    http: httpx.AsyncClient, tm: FakeTokenizerManager, prompt: list, input_ids: list
) -> None:
    body = (await complete(http, prompt=prompt)).json()
    assert [(obj.text, obj.input_ids) for obj in tm.received] == [(None, ids) for ids in input_ids]
    assert body["usage"]["prompt_tokens"] == sum(len(ids) for ids in input_ids)


async def test_echo_prepends_the_prompt(
    http: httpx.AsyncClient, tokenizer: PreTrainedTokenizerBase
) -> None:
    text = (await complete(http, echo=True)).json()["choices"][0]["text"]
    assert text == PROMPT + REPLY
    ids = tokenizer.encode(PROMPT)
    text = (await complete(http, prompt=ids, echo=True)).json()["choices"][0]["text"]
    assert text == tokenizer.decode(ids) + REPLY


async def test_logprobs_are_the_legacy_shape(
    http: httpx.AsyncClient, tm: FakeTokenizerManager, tokenizer: PreTrainedTokenizerBase
) -> None:
    body = (await complete(http, logprobs=2)).json()
    [obj] = tm.received
    assert (obj.return_logprob, obj.top_logprobs_num, obj.logprob_start_len) == (True, 2, -1)
    logprobs = body["choices"][0]["logprobs"]
    tokens = [tokenizer.decode([t]) for t in tokenizer.encode(REPLY)]
    assert logprobs["tokens"] == tokens
    assert logprobs["token_logprobs"] == [-(k + 1) / 10 for k in range(len(tokens))]
    assert all(
        len(top) == 2 and top[tok] == lp
        for tok, lp, top in zip(
            tokens, logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
        )
    )
    offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    assert logprobs["text_offset"] == offsets
    assert all(
        body["choices"][0]["text"][o:].startswith(t) for o, t in zip(offsets, tokens, strict=True)
    )


async def test_logprobs_zero_gives_the_sampled_token_only(http: httpx.AsyncClient) -> None:
    logprobs = (await complete(http, logprobs=0)).json()["choices"][0]["logprobs"]
    assert [list(top) for top in logprobs["top_logprobs"]] == [[tok] for tok in logprobs["tokens"]]


async def test_echo_with_logprobs_scores_the_prompt_too(
    http: httpx.AsyncClient, tm: FakeTokenizerManager, tokenizer: PreTrainedTokenizerBase
) -> None:
    body = (await complete(http, echo=True, logprobs=1)).json()
    assert tm.received[0].logprob_start_len == 0
    logprobs = body["choices"][0]["logprobs"]
    prompt_tokens = [tokenizer.decode([t]) for t in tokenizer.encode(PROMPT)]
    reply_tokens = [tokenizer.decode([t]) for t in tokenizer.encode(REPLY)]
    assert logprobs["tokens"] == prompt_tokens + reply_tokens
    n_prompt = len(prompt_tokens)
    assert logprobs["token_logprobs"][:n_prompt] == [None] + [-1.0] * (n_prompt - 1)
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1] == {prompt_tokens[1]: -1.0}
    assert logprobs["text_offset"][0] == 0
    assert logprobs["text_offset"][n_prompt] == len(PROMPT)  # the first output token


async def test_max_tokens_zero_with_echo_returns_just_the_prompt(
    http: httpx.AsyncClient, tm: FakeTokenizerManager
) -> None:
    tm.reply = lambda obj: ""
    tm.finish = FinishReason("length")
    body = (await complete(http, echo=True, max_tokens=0, logprobs=0)).json()
    assert tm.received[0].sampling_params.max_new_tokens == 0
    [choice] = body["choices"]
    assert (choice["text"], choice["finish_reason"]) == (PROMPT, "length")
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert body["usage"]["completion_tokens"] == 0


async def test_an_empty_prompt_is_a_400(http: httpx.AsyncClient, tm: FakeTokenizerManager) -> None:
    response = await complete(http, prompt=[])
    assert (response.status_code, response.json()["error"]["param"]) == (400, "prompt")
    assert tm.received == []


async def test_an_unknown_model_is_a_404(http: httpx.AsyncClient) -> None:
    response = await complete(http, model="davinci")
    assert (response.status_code, response.json()["error"]["code"]) == (404, "model_not_found")


async def test_stream_chunks_with_echo_and_usage(
    http: httpx.AsyncClient, tokenizer: PreTrainedTokenizerBase
) -> None:
    response = await complete(
        http, stream=True, echo=True, logprobs=0, stream_options={"include_usage": True}
    )
    *chunks, usage, done = sse_events(response.text)
    assert done == "[DONE]"
    choices = [chunk["choices"][0] for chunk in chunks]
    assert all(chunk["object"] == "text_completion" and chunk["usage"] is None for chunk in chunks)
    assert choices[0]["text"].startswith(PROMPT)
    assert "".join(c["text"] for c in choices) == PROMPT + REPLY
    assert choices[-1] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}
    tokens = [t for c in choices[:-1] for t in c["logprobs"]["tokens"]]
    prompt_ids, reply_ids = tokenizer.encode(PROMPT), tokenizer.encode(REPLY)
    assert tokens == [tokenizer.decode([t]) for t in prompt_ids + reply_ids]
    offsets = [o for c in choices[:-1] for o in c["logprobs"]["text_offset"]]
    assert offsets[len(prompt_ids)] == len(PROMPT) and offsets == sorted(offsets)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(reply_ids)


async def test_stream_of_two_prompts(http: httpx.AsyncClient, tm: FakeTokenizerManager) -> None:
    tm.reply = lambda obj: f" answer to {obj.text}."
    events = sse_events((await complete(http, stream=True, prompt=["A", "B"])).text)
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])
    for index, name in enumerate("AB"):
        mine = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == f" answer to {name}."
        assert mine[-1]["finish_reason"] == "stop"


async def test_the_openai_sdk_reads_completions(sdk: AsyncOpenAI) -> None:
    completion = await sdk.completions.create(
        model=MODEL, prompt=["A", "B"], n=2, max_tokens=20, logprobs=1
    )
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert all(c.text == REPLY and c.finish_reason == "stop" for c in completion.choices)
    assert completion.choices[0].logprobs.top_logprobs[0] == {
        completion.choices[0].logprobs.tokens[0]: pytest.approx(-0.1)
    }
    stream = await sdk.completions.create(
        model=MODEL, prompt=PROMPT, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == REPLY
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


async def test_a_client_disconnect_mid_stream_closes_the_engine_stream(
    tm: FakeTokenizerManager,
) -> None:
    tm.stall_after = 1
    body = {"prompt": PROMPT, "stream": True, "rid": "gone"}
    chunks = await disconnect_after_first_chunk(build_app(tm), "/v1/completions", body)
    assert chunks and "[DONE]" not in "".join(chunks)
    assert tm.closed_early == ["gone"]
