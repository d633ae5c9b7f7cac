"""What the OpenAI chat and completions handlers share: choices in, engine streams, JSON or SSE out.

One OpenAI request becomes one `GenerateReqInput` per choice: prompt `p`'s `n` choices get
indices `p*n .. p*n+n-1` and rid `<base>` when there is a single choice, `<base>-<index>` otherwise
(`<base>` is the request's `rid` or a fresh uuid4 hex; the response id is `<prefix>-<base>`). With a
`seed`, choice `j` of each prompt samples with `seed + j`, so the choices of one prompt differ while
a prompt's first choice equals the same request sent alone.

Errors: anything rejected before generation starts (bad routing header, engine rejection) is
raised as `RequestError` and becomes a plain HTTP error. A choice aborted later becomes, when not
streaming, the HTTP error of its abort status; when streaming, one SSE event
`data: {"error": {"message", ...}}` (the error body; the OpenAI SDK raises `APIError` on it) then
`data: [DONE]`. An abort of one choice ends the whole response and aborts the other choices.

Over 400 lines because the request flow, the choice streams it reads and the SSE body it writes
are one contract (who closes which stream, when an abort becomes which error).
"""

from __future__ import annotations

import asyncio
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Generic, Protocol, TypeVar

import anyio
import msgspec
from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse
from transformers import PreTrainedTokenizerBase

from berth_common.errors import RequestError
from berth_common.http import SSE_DONE, sse_event
from berth_runtime.constrained.spec import GrammarSpec
from berth_runtime.entrypoints.protocol import PromptTokensDetails, SamplingRequest, UsageInfo
from berth_runtime.io_struct import GenerateReqInput, RequestOutput
from berth_runtime.managers.lora_registry import LoraRegistry
from berth_runtime.sampling_params import SamplingParams
from berth_runtime.server_args import ServerArgs

Output = RequestOutput
RequestT = TypeVar("RequestT", bound=SamplingRequest)
T = TypeVar("T")

DP_RANK_HEADER = "X-Data-Parallel-Rank"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# How often a request that does not stream checks whether its client is still there.
DISCONNECT_POLL_S = 1.0


class EngineClient(Protocol):
    """The TokenizerManager surface the handlers use."""

    tokenizer: PreTrainedTokenizerBase
    args: ServerArgs
    model_name: str
    context_len: int
    max_sequences_per_request: int
    lora: LoraRegistry

    def generate_request(self, obj: GenerateReqInput) -> AsyncGenerator[Output, None]: ...

    async def run_tokenizer(self, fn: Callable[..., T], *args: object) -> T: ...

    def check_prompt_chars(self, chars: int, param: str) -> None: ...

    def check_grammar(self, spec: GrammarSpec, param: str) -> None: ...


class StreamChunker(Protocol):
    """Turns one streamed request's outputs into its protocol's chunk objects."""

    def opening(self) -> list[BaseModel]: ...

    def advance(self, index: int, out: Output) -> list[BaseModel]: ...

    def usage(self, usage: UsageInfo) -> BaseModel: ...


class OpenAIServingBase(ABC, Generic[RequestT]):
    """The request flow of an OpenAI endpoint; subclasses build choices and format answers."""

    id_prefix: str

    def __init__(self, tokenizer_manager: EngineClient) -> None:
        self.tokenizer_manager = tokenizer_manager

    async def handle_request(self, request: RequestT, raw_request: Request) -> Response:
        adapter = check_model(self.tokenizer_manager, request.model)
        check_sequences(request.sequence_count(), self.tokenizer_manager, "n")
        base_rid = request.rid or uuid.uuid4().hex
        check_grammar(self.tokenizer_manager, request)
        # Templating and tokenizing happen here: off the event loop.
        reqs = await self.tokenizer_manager.run_tokenizer(
            self.build_inputs, request, raw_request, base_rid
        )
        for req in reqs:
            req.lora_name = adapter
        streams = ChoiceStreams(self.tokenizer_manager, reqs, raw_request, request.stream)
        outputs = await streams.start()
        response_id = f"{self.id_prefix}-{base_rid}"
        if request.stream:
            chunker = self.chunker(request, response_id, reqs)
            return StreamingResponse(
                event_stream(streams, chunker, request.n, request.include_usage),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        await streams.close()
        response = self.build_response(request, response_id, reqs, outputs)
        return Response(response.model_dump_json(), media_type="application/json")

    @abstractmethod
    def build_inputs(
        self, request: RequestT, raw_request: Request, base_rid: str
    ) -> list[GenerateReqInput]:
        """One GenerateReqInput per choice, in choice-index order."""

    @abstractmethod
    def chunker(
        self, request: RequestT, response_id: str, reqs: list[GenerateReqInput]
    ) -> StreamChunker: ...

    @abstractmethod
    def build_response(
        self,
        request: RequestT,
        response_id: str,
        reqs: list[GenerateReqInput],
        outputs: list[Output],
    ) -> BaseModel:
        """The non-streaming answer from every choice's final output."""


def check_model(engine: EngineClient, model: str | None) -> str | None:
    """The LoRA adapter a request's `model` names (NAME or BASE:NAME), None for the served model
    (or no `model`); a 404 for anything this server does not serve."""
    return engine.lora.resolve(model)


def check_grammar(engine: EngineClient, request: SamplingRequest) -> None:
    """A grammar this server cannot enforce is the client's error, named by its field, before
    anything runs (an invalid one is refused by the scheduler, before it is queued)."""
    constraint = request.grammar()
    if constraint is not None:
        param, spec = constraint
        engine.check_grammar(spec, param)


def check_sequences(count: int, engine: EngineClient, param: str) -> None:
    """Refuse a request for more sequences than the server serves per request, before any work."""
    limit = engine.max_sequences_per_request
    if count > limit:
        raise RequestError(
            f"This request asks for {count} sequences (n times the prompts); this server "
            f"generates at most {limit} per request.",
            param=param,
        )


def choice_inputs(
    request: SamplingRequest,
    raw_request: Request,
    prompts: Sequence[str | list[int]],
    base_rid: str,
    sampling_params: SamplingParams,
    *,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    logprob_start_len: int = -1,
) -> list[GenerateReqInput]:
    """One GenerateReqInput per choice, in choice-index order (see the module docstring)."""
    dp_rank, priority = routing_signals(request, raw_request)
    constraint = request.grammar()
    total = len(prompts) * request.n
    reqs = []
    for index in range(total):
        prompt = prompts[index // request.n]
        params = sampling_params
        if request.seed is not None:
            params = msgspec.structs.replace(params, seed=request.seed + index % request.n)
        reqs.append(
            GenerateReqInput(
                text=prompt if isinstance(prompt, str) else None,
                input_ids=None if isinstance(prompt, str) else list(prompt),
                sampling_params=params,
                rid=base_rid if total == 1 else f"{base_rid}-{index}",
                stream=request.stream,
                return_logprob=return_logprob,
                top_logprobs_num=top_logprobs_num,
                logprob_start_len=logprob_start_len,
                routed_dp_rank=dp_rank,
                priority=priority,
                grammar_param=constraint[0] if constraint else None,
            )
        )
    return reqs


def sampling_params(request: SamplingRequest, max_new_tokens: int | None) -> SamplingParams:
    """The OpenAI sampling fields as SamplingParams (top_k 0 means disabled, like -1)."""
    constraint = request.grammar()
    grammar = {constraint[1].kind: constraint[1].source} if constraint else {}
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        min_new_tokens=request.min_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k or -1,
        min_p=request.min_p,
        stop=[request.stop] if isinstance(request.stop, str) else list(request.stop),
        stop_token_ids=list(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
        skip_special_tokens=request.skip_special_tokens,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        logit_bias=dict(request.logit_bias),
        seed=request.seed,
        **grammar,
    )


def routing_signals(
    request: SamplingRequest, raw_request: Request
) -> tuple[int | None, int | None]:
    """(DP rank, priority); a body field wins over its header. (A routing key is the router's:
    a rank has nothing to do with it.)"""
    dp_rank = request.routed_dp_rank
    header = raw_request.headers.get(DP_RANK_HEADER)
    if dp_rank is None and header is not None:
        try:
            dp_rank = int(header)
        except ValueError:
            dp_rank = -1
        if dp_rank < 0:
            raise RequestError(
                f"{DP_RANK_HEADER} must be a non-negative integer, got {header!r}",
                param=DP_RANK_HEADER,
            )
    return dp_rank, request.priority


def usage_info(outputs: Sequence[Output], n: int) -> UsageInfo:
    """Exact usage from each choice's latest output. As OpenAI bills it, a prompt counts once
    however many choices it has; its cached tokens are the fewest any of its choices found cached
    (what was cached before)."""
    per_prompt = [outputs[start : start + n] for start in range(0, len(outputs), n)]
    prompt_tokens = sum(group[0].prompt_tokens for group in per_prompt)
    completion_tokens = sum(out.completion_tokens for out in outputs)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(min(out.cached_tokens for out in group) for group in per_prompt)
        ),
    )


def finish_reason(out: Output) -> str | None:
    return None if out.finish_reason is None else out.finish_reason.type


def raise_if_aborted(out: Output) -> None:
    """An aborted choice (client gone, /abort_request, engine failure) as its RequestError."""
    reason = out.finish_reason
    if reason is not None and reason.type == "abort":
        raise RequestError(reason.message or "the request was aborted", reason.status_code or 500)


def finite(logprob: float) -> float:
    """A JSON-safe logprob: -inf (a token masked out) becomes -9999.0, as vLLM does."""
    return max(logprob, -9999.0)


async def event_stream(
    streams: ChoiceStreams, chunker: StreamChunker, n: int, include_usage: bool
) -> AsyncIterator[str]:
    """The SSE body: the chunks of every output, the usage chunk if asked for, then [DONE].

    Chunks carry `"usage": null` only when usage was asked for, as OpenAI's do. Closing this
    generator early (the client went away) closes the engine streams, which aborts their requests.
    """
    exclude = None if include_usage else {"usage"}
    try:
        for chunk in chunker.opening():
            yield sse_event(chunk, exclude)
        async for index, out in streams.outputs():
            raise_if_aborted(out)
            for chunk in chunker.advance(index, out):
                yield sse_event(chunk, exclude)
        if include_usage:
            yield sse_event(chunker.usage(usage_info(streams.latest, n)))
    except RequestError as err:
        yield sse_event(err.body())
    finally:
        await streams.close()
    yield SSE_DONE


class ChoiceStreams:
    """The engine output streams of one request's choices, read concurrently.

    Not streaming, each choice's outputs are joined into one final output (the engine sends one,
    at the end); streaming, they are read as they come. Watches for a client that goes away
    while no response has started (once streaming, the server notices by itself).
    """

    def __init__(
        self,
        engine: EngineClient,
        reqs: Sequence[GenerateReqInput],
        raw_request: Request | None,
        stream: bool,
    ) -> None:
        self._gens = [engine.generate_request(req) for req in reqs]
        self._raw_request = raw_request
        self._stream = stream
        self._pending: dict[int, asyncio.Future[Output]] = {}
        self.latest: list[Output] = []  # the newest output of each choice

    async def start(self) -> list[Output]:
        """Submit every choice and return its first output (its whole output when not
        streaming).

        A choice rejected before its first output, or aborted in it, closes all the others and
        raises its RequestError, so that the client gets a plain HTTP error, not a failing stream;
        so does a client that went away meanwhile (499).
        """
        self._pending = {index: self._read(index) for index in range(len(self._gens))}
        watcher = asyncio.ensure_future(_disconnected(self._raw_request))
        try:
            waiting = {*self._pending.values(), watcher}
            while True:
                done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if watcher in done:
                    raise RequestError("client disconnected", 499)
                for task in done:
                    error = task.exception()
                    if error is not None:
                        raise error
                if waiting == {watcher}:
                    break
            self.latest = [task.result() for task in self._pending.values()]
            for out in self.latest:
                raise_if_aborted(out)
        except BaseException:
            await self.close()
            raise
        finally:
            watcher.cancel()
        self._pending = {}
        for index, out in enumerate(self.latest):
            self._read_next_if_running(index, out)
        return self.latest

    async def outputs(self) -> AsyncIterator[tuple[int, Output]]:
        """Yield (index, output): the first outputs in index order, then later ones as they come."""
        for index, out in enumerate(self.latest):
            yield index, out
        if len(self._gens) == 1 and self._pending:
            # One choice (the usual case): read its stream directly, no task per output.
            gen = self._gens[0]
            out = await self._pending.pop(0)
            while True:
                self.latest[0] = out
                yield 0, out
                if out.finished:
                    return
                out = await anext(gen)
        while self._pending:
            done, _ = await asyncio.wait(
                self._pending.values(), return_when=asyncio.FIRST_COMPLETED
            )
            for index in sorted(i for i, task in self._pending.items() if task in done):
                out = self._pending.pop(index).result()
                self.latest[index] = out
                self._read_next_if_running(index, out)
                yield index, out

    async def close(self) -> None:
        """Stop reading and close every stream; the engine aborts the choices not yet finished.

        Shielded, so that it completes even when the caller is being cancelled (client gone).
        """
        pending, self._pending = list(self._pending.values()), {}
        with anyio.CancelScope(shield=True):
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for gen in self._gens:
                await gen.aclose()

    def _read(self, index: int) -> asyncio.Future[Output]:
        if self._stream:
            return asyncio.ensure_future(anext(self._gens[index]))
        return asyncio.ensure_future(_whole(self._gens[index]))

    def _read_next_if_running(self, index: int, out: Output) -> None:
        if not out.finished:
            self._pending[index] = self._read(index)


async def _whole(gen: AsyncGenerator[Output, None]) -> Output:
    """A request's outputs joined into one, up to its finish."""
    out = await anext(gen)
    while not out.finished:
        out = out.followed_by(await anext(gen))
    return out


async def _disconnected(raw_request: Request | None) -> None:
    """Return once the client has gone away (never, without a request to watch)."""
    if raw_request is None:
        await asyncio.Event().wait()
        return
    while not await raw_request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
