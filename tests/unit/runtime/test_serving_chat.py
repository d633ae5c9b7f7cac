"""/v1/chat/completions over a scripted TokenizerManager: fields, n, SSE, errors, disconnects.

The fake TokenizerManager, the test app and the helpers live in `fakes.py`, the fixtures in
`conftest.py`; the completions tests share them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from fastapi import Request
from openai import AsyncOpenAI
from transformers import PreTrainedTokenizerBase

from berth_common.errors import RequestError
from berth_runtime.entrypoints.protocol import ChatCompletionRequest
from berth_runtime.entrypoints.serving_chat import OpenAIServingChat
from berth_runtime.io_struct import FinishReason
from berth_runtime.sampling_params import SamplingParams
from tests.unit.runtime.fakes import (
    MODEL,
    REPLY,
    FakeTokenizerManager,
    build_app,
    disconnect_after_first_chunk,
    load_tokenizer,
    sse_events,
)

USER = [{"role": "user", "content": "What is the capital of France?"}]


async def post_chat(http: httpx.AsyncClient, **fields: Any) -> httpx.Response:
    return await http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": USER, **fields}
    )


# --- mapping onto GenerateReqInput --------------------------------------------------------------


async def test_every_field_maps_onto_the_generate_request(
    http: httpx.AsyncClient, tm: FakeTokenizerManager, tokenizer: PreTrainedTokenizerBase
) -> None:
    response = await post_chat(
        http,
        max_tokens=50,
        max_completion_tokens=40,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        stop=["\n\n", "END"],
        stop_token_ids=[2],
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logit_bias={"42": -100, "7": 2.5},
        logprobs=True,
        top_logprobs=3,
        ignore_eos=True,
        min_tokens=2,
        skip_special_tokens=False,
        user="u1",
        rid="req-1",
        routed_dp_rank=1,
        priority=5,
        routing_key="tenant-a",
        some_future_field={"x": 1},
    )
    assert response.status_code == 200, response.text
    assert response.json()["id"] == "chatcmpl-req-1"
    [obj] = tm.received
    assert obj.sampling_params == SamplingParams(
        max_new_tokens=40,
        min_new_tokens=2,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        stop=["\n\n", "END"],
        stop_token_ids=[2],
        ignore_eos=True,
        skip_special_tokens=False,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logit_bias={42: -100.0, 7: 2.5},
        seed=7,
    )
    expected_ids = tokenizer.apply_chat_template(USER, add_generation_prompt=True)["input_ids"]
    assert (obj.text, obj.input_ids) == (None, expected_ids)
    assert (obj.rid, obj.stream, obj.return_logprob, obj.top_logprobs_num) == (
        "req-1",
        False,
        True,
        3,
    )
    assert obj.logprob_start_len == -1
    assert (obj.routed_dp_rank, obj.priority) == (1, 5)


async def test_defaults_leave_the_budget_to_the_context_limit(
    http: httpx.AsyncClient, tm: FakeTokenizerManager
) -> None:
    response = await http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 9})
    assert response.status_code == 200  # no model: the served one
    assert response.json()["model"] == MODEL
    await post_chat(http, stop="END", top_k=0)
    first, second = tm.received
    assert first.sampling_params == SamplingParams(max_new_tokens=9)
    assert second.sampling_params == SamplingParams(stop=["END"], top_k=-1)
    assert len(second.rid) == 32 and not second.return_logprob
    assert (second.routed_dp_rank, second.priority) == (None, None)


async def test_text_parts_and_roles_go_through_the_chat_template(
    http: httpx.AsyncClient, tm: FakeTokenizerManager, tokenizer: PreTrainedTokenizerBase
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
        },
        {"role": "assistant", "content": "Hello!"},
        {"role": "tool", "content": "42"},
    ]
    assert (await post_chat(http, messages=messages)).status_code == 200
    rendered = tokenizer.decode(tm.received[0].input_ids)
    assert rendered.startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi\nthere"
    )
    assert rendered.endswith("<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")


async def test_a_chat_template_error_is_a_400(
    http: httpx.AsyncClient, tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    template = "{{ raise_exception('Conversation roles must alternate') }}"
    monkeypatch.setattr(tokenizer, "chat_template", template)
    response = await post_chat(http)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"
    assert "Conversation roles must alternate" in response.json()["error"]["message"]


async def test_n_choices_get_their_own_rids_and_seeds(
    http: httpx.AsyncClient, tm: FakeTokenizerManager
) -> None:
    tm.reply = lambda obj: f"Answer {obj.sampling_params.seed}."
    tm.cached_tokens = lambda obj: 0 if obj.rid.endswith("-0") else 30
    body = (await post_chat(http, n=3, seed=100, rid="multi")).json()
    assert [obj.rid for obj in tm.received] == ["multi-0", "multi-1", "multi-2"]
    assert [obj.sampling_params.seed for obj in tm.received] == [100, 101, 102]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == [
        "Answer 100.",
        "Answer 101.",
        "Answer 102.",
    ]
    prompt_tokens = len(tm.received[0].input_ids)
    completion_tokens = sum(len(tm.tokenizer.encode(f"Answer {s}.")) for s in (100, 101, 102))
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,  # once, though three choices read it
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},  # what was cached before the request
    }


async def test_n_without_seed_leaves_seeds_unset(
    http: httpx.AsyncClient, tm: FakeTokenizerManager
) -> None:
    await post_chat(http, n=2)
    assert [obj.sampling_params.seed for obj in tm.received] == [None, None]


# --- routing signals ----------------------------------------------------------------------------


async def test_the_rank_header_fills_in_what_the_body_does_not_set(
    http: httpx.AsyncClient, tm: FakeTokenizerManager
) -> None:
    headers = {"X-Data-Parallel-Rank": "3", "X-Routing-Key": "session-9"}
    await http.post("/v1/chat/completions", json={"messages": USER}, headers=headers)
    await http.post(
        "/v1/chat/completions",
        json={"messages": USER, "routed_dp_rank": 0, "routing_key": "body"},
        headers=headers,
    )
    assert [o.routed_dp_rank for o in tm.received] == [3, 0]


@pytest.mark.parametrize("rank", ["abc", "-1", "1.5"])
async def test_a_bad_rank_header_is_a_400(
    http: httpx.AsyncClient, tm: FakeTokenizerManager, rank: str
) -> None:
    response = await http.post(
        "/v1/chat/completions", json={"messages": USER}, headers={"X-Data-Parallel-Rank": rank}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "X-Data-Parallel-Rank"
    assert tm.received == []


# --- errors ---------------------------------------------------------------------------------------


async def test_an_unknown_model_is_a_404(http: httpx.AsyncClient, tm: FakeTokenizerManager) -> None:
    response = await post_chat(http, model="gpt-4o")
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model `gpt-4o` does not exist; this server serves `smollm2`.",
            "type": "NotFoundError",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert tm.received == []


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 5}, "temperature"),
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias.not-a-token"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
        ),
        ({"n": 129}, "n"),
    ],
)
async def test_invalid_fields_are_400s_naming_the_field(
    http: httpx.AsyncClient, fields: dict[str, Any], param: str
) -> None:
    response = await post_chat(http, **fields)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert response.json()["error"]["message"]


async def test_an_engine_rejection_is_a_plain_http_error_even_when_streaming(
    http: httpx.AsyncClient, tm: FakeTokenizerManager
) -> None:
    tm.reject = {"r": RequestError("The request queue is full.", 503)}
    response = await post_chat(http, rid="r", stream=True)
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["message"] == "The request queue is full."


async def test_one_rejected_choice_aborts_the_others(
    http: httpx.AsyncClient, tm: FakeTokenizerManager
) -> None:
    tm.reject = {"r-1": RequestError("a request with rid 'r-1' is already running", 400)}
    tm.stall_after = 0
    response = await post_chat(http, rid="r", n=3)
    assert response.status_code == 400
    assert sorted(tm.closed_early) == ["r-0", "r-2"]


async def test_an_aborted_request_is_an_error_with_the_abort_status(
    http: httpx.AsyncClient, tm: FakeTokenizerManager, sdk: AsyncOpenAI
) -> None:
    tm.finish = FinishReason("abort", message="engine died", status_code=500)
    response = await post_chat(http)
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "engine died"
    with pytest.raises(openai.InternalServerError, match="engine died"):
        await sdk.chat.completions.create(model=MODEL, messages=USER)


async def test_an_abort_in_the_first_output_is_a_plain_http_error_even_when_streaming(
    http: httpx.AsyncClient, tm: FakeTokenizerManager
) -> None:
    tm.reply = lambda obj: ""
    tm.finish = FinishReason("abort", message="The request queue is full.", status_code=503)
    response = await post_chat(http, stream=True, n=2)
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "The request queue is full."


async def test_an_abort_mid_stream_is_an_error_event_then_done(
    http: httpx.AsyncClient, tm: FakeTokenizerManager, sdk: AsyncOpenAI
) -> None:
    tm.finish = FinishReason("abort", message="aborted by request", status_code=499)
    response = await post_chat(http, stream=True)
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    assert events[-2] == {
        "error": {
            "message": "aborted by request",
            "type": "BadRequestError",
            "param": None,
            "code": 499,
        }
    }
    assert all("choices" in event for event in events[:-2])
    stream = await sdk.chat.completions.create(model=MODEL, messages=USER, stream=True)
    with pytest.raises(openai.APIError, match="aborted by request"):
        async for _ in stream:
            pass


# --- responses ------------------------------------------------------------------------------------


async def test_a_length_finish_is_reported(
    http: httpx.AsyncClient, tm: FakeTokenizerManager
) -> None:
    tm.finish = FinishReason("length")
    body = (await post_chat(http, max_tokens=8)).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["object"] == "chat.completion" and body["system_fingerprint"] is None


async def test_logprobs_cover_every_output_token(
    http: httpx.AsyncClient, tm: FakeTokenizerManager, tokenizer: PreTrainedTokenizerBase
) -> None:
    body = (await post_chat(http, logprobs=True, top_logprobs=4)).json()
    content = body["choices"][0]["logprobs"]["content"]
    reply_ids = tokenizer.encode(REPLY)
    assert [entry["token"] for entry in content] == [tokenizer.decode([t]) for t in reply_ids]
    assert [entry["logprob"] for entry in content] == [-(k + 1) / 10 for k in range(len(reply_ids))]
    first = content[0]
    assert first["bytes"] == list(first["token"].encode())
    assert [top["logprob"] for top in first["top_logprobs"]] == [-0.1, -1.1, -2.1, -9999.0]
    assert first["top_logprobs"][0]["token"] == first["token"]

    no_top = (await post_chat(http, logprobs=True)).json()["choices"][0]["logprobs"]["content"]
    assert len(no_top) == len(reply_ids) and all(entry["top_logprobs"] == [] for entry in no_top)
    assert (await post_chat(http)).json()["choices"][0]["logprobs"] is None


async def test_the_openai_sdk_reads_a_chat_completion(sdk: AsyncOpenAI) -> None:
    completion = await sdk.chat.completions.create(
        model=MODEL, messages=USER, n=2, seed=1, logprobs=True, top_logprobs=2
    )
    assert [choice.message.content for choice in completion.choices] == [REPLY, REPLY]
    assert completion.choices[1].finish_reason == "stop"
    assert completion.choices[0].logprobs.content[0].top_logprobs[1].logprob == pytest.approx(-1.1)
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 2 * len(
        load_tokenizer().encode(REPLY)
    )
    assert completion.id.startswith("chatcmpl-")


# --- streaming ------------------------------------------------------------------------------------


async def test_stream_chunk_order_with_usage(
    http: httpx.AsyncClient, tm: FakeTokenizerManager
) -> None:
    tm.cached_tokens = lambda obj: 5
    response = await post_chat(http, stream=True, stream_options={"include_usage": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    *chunks, usage, done = events
    assert done == "[DONE]"
    assert len({chunk["id"] for chunk in events[:-1]}) == 1
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in events[:-1])
    assert all(chunk["usage"] is None for chunk in chunks)
    first, *deltas, finish = (chunk["choices"][0] for chunk in chunks)
    assert first == {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    assert "".join(d["delta"]["content"] for d in deltas) == REPLY
    assert len(deltas) > 1 and all(set(d["delta"]) == {"content"} for d in deltas)
    assert all(d["finish_reason"] is None for d in deltas)
    assert finish == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == len(tm.tokenizer.encode(REPLY))
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}


async def test_stream_without_usage_has_no_usage_field(http: httpx.AsyncClient) -> None:
    events = sse_events((await post_chat(http, stream=True)).text)
    assert events[-1] == "[DONE]"
    assert all("usage" not in chunk and chunk["choices"] for chunk in events[:-1])


async def test_n_streams_interleave_by_index(
    http: httpx.AsyncClient, tm: FakeTokenizerManager
) -> None:
    short = "It is Paris."
    tm.reply = lambda obj: short if obj.rid.endswith("-0") else REPLY
    events = sse_events((await post_chat(http, stream=True, n=2)).text)[:-1]
    choices = [chunk["choices"][0] for chunk in events]
    assert [c["delta"] for c in choices[:2]] == [{"role": "assistant", "content": ""}] * 2
    for index, reply in ((0, short), (1, REPLY)):
        mine = [c for c in choices if c["index"] == index]
        assert "".join(c["delta"].get("content", "") for c in mine) == reply
        assert [c["finish_reason"] for c in mine][-1] == "stop"
        assert all(c["finish_reason"] is None for c in mine[:-1])
    indices = [c["index"] for c in choices[2:]]
    assert indices != sorted(indices)  # interleaved, not one choice after the other


async def test_stream_logprobs_ride_on_the_chunks_of_their_tokens(http: httpx.AsyncClient) -> None:
    events = sse_events((await post_chat(http, stream=True, logprobs=True, top_logprobs=1)).text)
    deltas = [c["choices"][0] for c in events[:-1] if c["choices"][0]["delta"].get("content")]
    streamed = [entry for d in deltas for entry in d["logprobs"]["content"]]
    full = (await post_chat(http, logprobs=True, top_logprobs=1)).json()["choices"][0]["logprobs"]
    assert streamed == full["content"]
    assert all(len(d["logprobs"]["content"]) == 2 for d in deltas[:-1])


async def test_the_openai_sdk_reads_a_chat_stream(sdk: AsyncOpenAI) -> None:
    stream = await sdk.chat.completions.create(
        model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


# --- disconnects ----------------------------------------------------------------------------------


async def test_a_client_disconnect_mid_stream_closes_the_engine_streams(
    tm: FakeTokenizerManager,
) -> None:
    tm.stall_after = 1
    tm.reply = lambda obj: "Hi." if obj.rid == "gone-0" else REPLY  # choice 0: one output
    tm.cleanup_awaits = 3
    body = {"messages": USER, "stream": True, "n": 2, "rid": "gone"}
    chunks = await disconnect_after_first_chunk(build_app(tm), "/v1/chat/completions", body)
    assert chunks and "[DONE]" not in "".join(chunks)
    # Both cleanups ran to the end before the response did, though the client's leaving
    # cancelled the response: the finished choice was closed, the running one aborted.
    assert sorted(tm.ended) == ["gone-0", "gone-1"]
    assert tm.closed_early == ["gone-1"]


async def test_a_cancelled_non_streaming_request_closes_the_engine_stream(
    tm: FakeTokenizerManager,
) -> None:
    tm.stall_after = 0
    request = ChatCompletionRequest.model_validate({"messages": USER, "rid": "waiting"})
    raw_request = Request({"type": "http", "headers": []})
    task = asyncio.create_task(OpenAIServingChat(tm).handle_request(request, raw_request))
    while not tm.received:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert tm.closed_early == ["waiting"]
