"""TokenizerManager (API process): GenerateReqInput -> ReqState + TokenizedGenerateReqInput, and
the engine's outputs back to the awaiting HTTP handler.

Over 400 lines because admission (limits, tokenizing off the loop), the request's life (its state,
aborts, drain) and the engine's outputs coming back all act on the same `rid_to_state`; split,
each part would reach into the others' state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio

from berth_common.errors import EngineDeadError, RequestError
from berth_runtime.constrained.spec import GrammarSpec
from berth_runtime.io_struct import (
    AbortReq,
    BatchOutput,
    FinishReason,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReqInput,
    LoraAdapterOut,
    ReqOutput,
    RequestOutput,
    SchedulerBusy,
    SchedulerStats,
    Timing,
    TokenizedGenerateReqInput,
    TokenLogprob,
    ToTokenizer,
)
from berth_runtime.managers.engine_liveness import EngineLiveness
from berth_runtime.managers.lora_registry import LoraRegistry
from berth_runtime.metrics import MetricsCollector
from berth_runtime.sampling_params import SamplingParamsError
from berth_runtime.server_args import ServerArgs
from berth_runtime.utils.token_bytes import vocab_bytes
from berth_runtime.utils.zmq_ipc import PortArgs

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_AFTER_S = 1


@dataclass
class ReqState:
    """API-side state of one request, created before tokenization and kept in `rid_to_state`."""

    obj: GenerateReqInput
    event: asyncio.Event = field(default_factory=asyncio.Event)
    out_list: list[RequestOutput] = field(default_factory=list)  # arrived, not yet handed over
    finished: bool = False
    finish_reason: FinishReason | None = None
    # The latest counts, for metrics and the log.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    input_ids: list[int] = field(default_factory=list)
    # Time stamps (time.time()) along the chain.
    received_time: float = field(default_factory=time.time)
    tokenized_time: float = 0.0
    queued_time: float = 0.0
    scheduled_time: float = 0.0
    first_token_time: float = 0.0
    finished_time: float = 0.0
    last_output_time: float = 0.0  # when the API last received tokens (for TTFT / ITL)

    def push(self, out: RequestOutput) -> None:
        self.out_list.append(out)
        if out.finish_reason is not None:
            self.finished = True
            self.finish_reason = out.finish_reason
        self.event.set()


class TokenizerManager:
    """Tokenizes requests, sends them to the scheduler, and streams results back per request."""

    def __init__(
        self,
        args: ServerArgs,
        ports: PortArgs,
        model_path: str,
        engine_info: dict,
        metrics: MetricsCollector,
    ) -> None:
        from transformers import AutoTokenizer

        self.args = args
        self.model_name = args.model_name
        self.model_path = model_path
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.engine_info = engine_info
        self.context_len: int = engine_info["context_len"]
        self.max_sequences_per_request = args.max_sequences_per_request
        self.max_total_tokens: int = engine_info["max_total_num_tokens"]
        self.vocab_size: int = engine_info["vocab_size"]
        self.rid_to_state: dict[str, ReqState] = {}
        self.last_stats: SchedulerStats | None = None
        self.liveness = EngineLiveness(last_heartbeat=time.monotonic())
        self.draining = False
        self.dead_reason: str | None = None
        self._flush_waiters: list[asyncio.Future[FlushCacheOut]] = []
        self._token_text_cache: dict[int, str] = {}
        self.vocab_bytes = vocab_bytes(self.tokenizer)
        self.metrics = metrics
        self.metrics.set_engine_info(
            self.context_len, self.max_total_tokens, engine_info.get("max_loras_per_batch")
        )
        # Templating and tokenizing a long prompt on the event loop would hold up every other
        # request, and /health, for as long: one worker thread does it, in arrival order.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="berth-tokenize")
        # No token of this vocabulary is longer than this many characters, so a prompt longer
        # than context_len of them cannot fit, and is refused without tokenizing it.
        self.max_prompt_chars = self.context_len * longest_token_chars(self.tokenizer)

        self.ctx = zmq.asyncio.Context()
        self.send_to_scheduler = self.ctx.socket(zmq.PUSH)
        self.send_to_scheduler.setsockopt(zmq.LINGER, 0)
        self.send_to_scheduler.connect(ports.scheduler_input)
        self.recv_from_engine = self.ctx.socket(zmq.PULL)
        self.recv_from_engine.bind(ports.tokenizer_input)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(ToTokenizer)
        self._loop_task: asyncio.Task[None] | None = None
        self.lora = LoraRegistry(
            self.model_name,
            args.enable_lora,
            engine_info.get("lora_adapters", {}),
            lambda msg: self.send_to_scheduler.send(self.encoder.encode(msg)),
        )

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start consuming engine outputs (call from inside the server's event loop)."""
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._handle_loop())

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self.ctx.destroy(linger=0)

    def mark_engine_dead(self, reason: str) -> None:
        """A child process died: fail every in-flight request now instead of letting it hang."""
        self.dead_reason = reason
        self.lora.fail_all(reason)
        dead = FinishReason("abort", message=reason, status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
        for rid, state in self.rid_to_state.items():
            if not state.finished:
                state.push(RequestOutput(rid=rid, text="", token_ids=[], finish_reason=dead))

    # --- the request path ----------------------------------------------------------------------

    async def run_tokenizer(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn` (templating, tokenizing) on the tokenizer thread, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    def check_grammar(self, spec: GrammarSpec, param: str) -> None:
        """Refuse a grammar when constrained decoding is off. Whether a grammar is valid is the
        scheduler's answer (it compiles each before queueing the request): xgrammar is not
        loaded here, since it imports torch."""
        if self.args.grammar_backend == "none":
            raise RequestError(
                "constrained decoding is off on this server (--grammar-backend none)", param=param
            )

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing, a prompt too long in characters to fit in the context."""
        if chars > self.max_prompt_chars:
            raise RequestError(
                f"The prompt is too long: this model's maximum context length is "
                f"{self.context_len} tokens, and the prompt's {chars} characters cannot fit in "
                "it. Please reduce the prompt.",
                param=param,
                code="context_length_exceeded",
            )

    async def generate_request(self, obj: GenerateReqInput) -> AsyncGenerator[RequestOutput, None]:
        """Run one request; yield its outputs (each step's new part if streaming, else one at the
        end).

        Rejections raise RequestError before the first yield, and so does an abort that arrives
        before any output. Closing the generator early (the client went away) aborts the request
        in the scheduler.
        """
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.draining:
            # Another replica (or this one's successor) can take it: say when to try again.
            raise RequestError(
                "the server is shutting down",
                HTTPStatus.SERVICE_UNAVAILABLE,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self._check_rank(obj)
        self.lora.check_name(obj.lora_name, "lora_path")
        spec = obj.sampling_params.grammar if obj.sampling_params else None
        if spec is not None:
            self.check_grammar(spec, obj.grammar_param or f"sampling_params.{spec.kind}")
        text_ids = None
        if obj.input_ids is None and obj.text is not None:
            self.check_prompt_chars(len(obj.text), "prompt")
            text_ids = await self.run_tokenizer(self._encode, obj.text)
        rid = obj.rid or uuid.uuid4().hex
        if rid in self.rid_to_state:
            raise RequestError(f"a request with rid {rid!r} is already running", param="rid")
        state = ReqState(obj=obj)
        self.rid_to_state[rid] = state
        sent = False
        try:
            tokenized = self._tokenize(obj, rid, state, text_ids)
            self.send_to_scheduler.send(self.encoder.encode(tokenized))
            sent = True
            first = True
            while True:
                await state.event.wait()
                state.event.clear()
                outs, state.out_list = state.out_list, []
                for out in outs:
                    reason = out.finish_reason
                    if first and reason is not None and reason.type == "abort":
                        raise self._abort_error(reason, obj)
                    first = False
                    yield out
                if state.finished:
                    return
        finally:
            if not state.finished and self.dead_reason is None:
                self._send_abort(rid, "client disconnected")
            self.rid_to_state.pop(rid, None)
            if sent:
                self._record_finished(rid, state)

    def _check_rank(self, obj: GenerateReqInput) -> None:
        """A request pinned to another data-parallel rank is refused, not served here."""
        own = self.args.dp_rank or 0
        if obj.routed_dp_rank is not None and obj.routed_dp_rank != own:
            raise RequestError(
                f"routed_dp_rank {obj.routed_dp_rank} names another rank: this server is rank "
                f"{own}; send it through the router, or to that rank",
                param="routed_dp_rank",
            )

    def _record_finished(self, rid: str, state: ReqState) -> None:
        """Metrics and the per-request debug line, once, when the request leaves the API."""
        reason = state.finish_reason
        aborted = reason is None or reason.type == "abort"
        now = time.time()
        if state.obj.log_metrics:
            self.metrics.observe_finished(
                received_time=state.received_time,
                tokenized_time=state.tokenized_time,
                scheduled_time=state.scheduled_time,
                prompt_tokens=state.prompt_tokens or len(state.input_ids),
                completion_tokens=state.completion_tokens,
                cached_tokens=state.cached_tokens,
                aborted=aborted,
                now=now,
                lora_name=state.obj.lora_name,
            )
        if logger.isEnabledFor(logging.DEBUG):
            ttft = state.first_token_time - state.received_time if state.first_token_time else -1
            logger.debug(
                "Finished rid=%s reason=%s prompt_tokens=%d completion_tokens=%d "
                "cached_tokens=%d ttft=%.3fs e2e=%.3fs",
                rid,
                "client_gone" if reason is None else reason.type,
                state.prompt_tokens or len(state.input_ids),
                state.completion_tokens,
                state.cached_tokens,
                ttft,
                now - state.received_time,
            )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    def _tokenize(
        self, obj: GenerateReqInput, rid: str, state: ReqState, text_ids: list[int] | None
    ) -> TokenizedGenerateReqInput:
        if obj.input_ids is not None:
            input_ids = list(obj.input_ids)
            if any(not 0 <= t < self.vocab_size for t in input_ids):
                raise RequestError(
                    f"prompt token ids must be in [0, {self.vocab_size})", param="prompt"
                )
        elif text_ids is not None:
            input_ids = text_ids
        else:
            raise RequestError("either text or input_ids is required", param="prompt")
        if not input_ids:
            raise RequestError("the prompt is empty", param="prompt")

        try:
            params = obj.sampling_params.normalized()
            params.verify(self.vocab_size)
        except SamplingParamsError as e:
            raise RequestError(str(e), param=e.param) from e
        prompt_len = len(input_ids)
        max_new = params.max_new_tokens
        wanted = prompt_len + (max_new or 0)
        if prompt_len >= self.context_len or wanted > self.context_len:
            # "prompt is too long" and the code are what LangChain and LiteLLM look for to raise
            # their context-overflow errors (on which agents trim their history and retry).
            raise RequestError(
                f"The prompt is too long: this model's maximum context length is "
                f"{self.context_len} tokens. However, you requested {wanted} tokens ({prompt_len} "
                f"in the prompt, {max_new or 0} for the completion). Please reduce the prompt or "
                "the completion length.",
                param="messages" if max_new is None else "max_tokens",
                code="context_length_exceeded",
            )
        if prompt_len + max(max_new or 1, 1) > self.max_total_tokens:
            raise RequestError(
                f"the request needs {prompt_len + (max_new or 1)} tokens of KV cache but the "
                "server "
                f"holds at most {self.max_total_tokens}",
                param="max_tokens",
            )
        room = self.context_len - prompt_len
        if params.min_new_tokens > room:
            raise RequestError(
                f"min_tokens is {params.min_new_tokens}, but the context leaves room for at most "
                f"{room} tokens after this prompt",
                param="min_tokens",
            )
        if obj.top_logprobs_num < 0 or obj.top_logprobs_num > 20:
            raise RequestError("top_logprobs must be between 0 and 20", param="top_logprobs")
        if not -1 <= obj.logprob_start_len < prompt_len:
            raise RequestError(
                f"logprob_start_len must be -1 (no prompt logprobs) or a prompt position in "
                f"[0, {prompt_len}), got {obj.logprob_start_len}",
                param="logprob_start_len",
            )

        state.input_ids = input_ids
        state.tokenized_time = time.time()
        return TokenizedGenerateReqInput(
            rid=rid,
            input_ids=input_ids,
            sampling_params=params,
            stream=obj.stream,
            return_logprob=obj.return_logprob,
            top_logprobs_num=obj.top_logprobs_num if obj.return_logprob else 0,
            logprob_start_len=obj.logprob_start_len,
            priority=obj.priority,
            lora_name=obj.lora_name,
        )

    def _abort_error(self, reason: FinishReason, obj: GenerateReqInput) -> RequestError:
        status = reason.status_code or HTTPStatus.INTERNAL_SERVER_ERROR
        headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
        if status == HTTPStatus.INTERNAL_SERVER_ERROR and self.dead_reason:
            return EngineDeadError(self.dead_reason)
        # The scheduler blames a field only for a refused grammar: name it as the client sent it.
        param = (obj.grammar_param or reason.param) if reason.param else None
        message = reason.message or "request aborted"
        return RequestError(message, status, headers=headers, param=param)

    def _send_abort(self, rid: str, message: str) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.send_to_scheduler.send(self.encoder.encode(AbortReq(rid=rid, message=message)))

    def abort_request(self, rid: str = "", abort_all: bool = False) -> bool:
        """`POST /abort_request`: abort `rid` and its choices (`rid-0`, `rid-1`, ... for n > 1).

        Returns True if a matching request was in flight.
        """
        if abort_all:
            targets = [""]
        else:
            targets = [r for r in self.rid_to_state if r == rid or r.startswith(f"{rid}-")]
        for target in targets:
            msg = AbortReq(
                rid=target, abort_all=abort_all, message="aborted by request", status_code=499
            )
            self.send_to_scheduler.send(self.encoder.encode(msg))
        return bool(targets)

    async def flush_cache(self) -> FlushCacheOut:
        future: asyncio.Future[FlushCacheOut] = asyncio.get_running_loop().create_future()
        self._flush_waiters.append(future)
        self.send_to_scheduler.send(self.encoder.encode(FlushCacheReq()))
        return await asyncio.wait_for(future, timeout=10)

    # --- engine outputs ------------------------------------------------------------------------

    async def _handle_loop(self) -> None:
        while True:
            frame = await self.recv_from_engine.recv(copy=False)
            msg = self.decoder.decode(frame.buffer)
            if isinstance(msg, BatchOutput):
                self._handle_batch_output(msg)
            elif isinstance(msg, SchedulerStats):
                self.last_stats = msg
                self.liveness.heartbeat(time.monotonic())
                self.metrics.observe_stats(msg)
            elif isinstance(msg, SchedulerBusy):
                self.liveness.busy(time.monotonic(), msg.step_s)
            elif isinstance(msg, LoraAdapterOut):
                self.lora.answer(msg)
            elif isinstance(msg, FlushCacheOut):
                waiters, self._flush_waiters = self._flush_waiters, []
                for w in waiters:
                    if not w.done():
                        w.set_result(msg)

    def _handle_batch_output(self, batch: BatchOutput) -> None:
        now = time.time()
        for out in batch.outputs:
            state = self.rid_to_state.get(out.rid)
            if state is None or state.finished:
                continue  # aborted or already failed
            self._observe_tokens(state, out, now)
            state.prompt_tokens = out.prompt_tokens
            state.completion_tokens = out.completion_tokens
            state.cached_tokens = out.cached_tokens
            state.queued_time = out.queued_time or state.queued_time
            state.scheduled_time = out.scheduled_time or state.scheduled_time
            state.first_token_time = out.first_token_time or state.first_token_time
            if out.finish_reason is not None:
                state.finished_time = now
            state.push(self._request_output(out, state))

    def _observe_tokens(self, state: ReqState, out: ReqOutput, now: float) -> None:
        """TTFT and inter-token latency as the client sees them. A request that does not stream
        gets all its tokens at once: its first token counts when the scheduler made it, the rest
        spread evenly up to now."""
        num_new = len(out.new_token_ids)
        if not num_new or not state.obj.log_metrics:
            return
        if state.last_output_time:
            self.metrics.observe_tokens(now - state.last_output_time, num_new)
        elif state.obj.stream or not out.first_token_time:
            self.metrics.observe_first_token(state.received_time, now)
        else:
            self.metrics.observe_first_token(state.received_time, out.first_token_time)
            if num_new > 1:
                self.metrics.observe_tokens(now - out.first_token_time, num_new - 1)
        state.last_output_time = now

    def _request_output(self, out: ReqOutput, state: ReqState) -> RequestOutput:
        """The handler's view of one engine output: logprobs carry their token's text."""
        result = RequestOutput(
            rid=out.rid,
            text=out.text,
            token_ids=out.new_token_ids,
            finish_reason=out.finish_reason,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
        )
        if out.output_token_logprobs is not None:
            result.logprobs = [
                self.token_logprob(lp, tid)
                for lp, tid in zip(out.output_token_logprobs, out.new_token_ids)
            ]
            if out.output_top_logprobs is not None:
                result.top_logprobs = [self._with_text(top) for top in out.output_top_logprobs]
        if out.input_token_logprobs is not None and state.obj.logprob_start_len == 0:
            result.prompt_logprobs = [
                self.token_logprob(lp, tid)
                for lp, tid in zip(out.input_token_logprobs, state.input_ids)
            ]
            if out.input_top_logprobs is not None:
                result.prompt_top_logprobs = [
                    None if top is None else self._with_text(top) for top in out.input_top_logprobs
                ]
        if out.finish_reason is not None:
            result.timing = Timing(
                received=state.received_time,
                tokenized=state.tokenized_time,
                queued=state.queued_time,
                scheduled=state.scheduled_time,
                first_token=state.first_token_time,
                finished=state.finished_time,
            )
        return result

    def token_logprob(self, logprob: float | None, token_id: int) -> TokenLogprob:
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text_cache[token_id] = text
        vocab = self.vocab_bytes
        known = token_id < len(vocab)
        return TokenLogprob(logprob, token_id, text, vocab[token_id] if known else b"")

    def _with_text(self, top: list[tuple[float, int]]) -> list[TokenLogprob]:
        return [self.token_logprob(lp, tid) for lp, tid in top]


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token decodes to: the longest vocabulary entry (a
    byte-level or SentencePiece entry has at least one symbol per character it decodes to)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)
