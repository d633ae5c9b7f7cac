"""Every message that crosses a process boundary, plus the API side's GenerateReqInput (what a
handler asks the engine) and RequestOutput (what it gets back).

Naming follows SGLang: `*ReqInput` goes into the engine, `*Out` comes out of it, `Batch*`
carries one entry per request of a scheduler step. Wire structs are tagged msgspec structs, so
a socket decodes exactly its own union and rejects anything else. No torch here: token ids
travel as lists.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from berth_runtime.sampling_params import SamplingParams


class GenerateReqInput(msgspec.Struct, kw_only=True):
    """One generation request as the API layer hands it to the TokenizerManager (one choice).

    Protocol-neutral: `serving_chat` / `serving_completions` / native `/generate` build it.
    Exactly one of `text` or `input_ids` is set.
    """

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    rid: str | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # -1: logprobs of output tokens only; 0: of the prompt too (completions `echo` + `logprobs`).
    logprob_start_len: int = -1
    # The data-parallel rank the client pinned (refused unless it is this server's own) and the
    # scheduling priority.
    routed_dp_rank: int | None = None
    priority: int | None = None
    # False for internal probes (/health_generate): they do not count in the metrics.
    log_metrics: bool = True
    # Where the client put the grammar (an OpenAI field such as `response_format`): the field a
    # refused grammar's 400 names, instead of `sampling_params.<kind>`.
    grammar_param: str | None = None
    # The LoRA adapter to run under (None: the base model).
    lora_name: str | None = None


class TokenLogprob(msgspec.Struct, frozen=True, gc=False):
    """One position's token with its logprob (None: the first prompt token has none)."""

    logprob: float | None
    token_id: int
    token: str  # the token's text (U+FFFD for part of a character)
    token_bytes: bytes  # its own bytes: a byte-level token may hold part of a character


class Timing(msgspec.Struct, frozen=True, gc=False):
    """A finished request's time.time() stamps along the chain (0.0: a step it skipped)."""

    received: float
    tokenized: float
    queued: float
    scheduled: float
    first_token: float
    finished: float


class RequestOutput(msgspec.Struct, kw_only=True, gc=False):
    """What a handler receives from the engine for one request: the new part of its output.

    A streaming request yields one per step it advanced in; any other request yields one, when
    it finishes. Counts are totals so far; text, token ids and logprobs are what is new.
    """

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # of token_ids, when asked for
    top_logprobs: list[list[TokenLogprob]] | None = None  # when top_logprobs_num > 0
    # The prompt's logprobs (logprob_start_len == 0), in the first output only.
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_top_logprobs: list[list[TokenLogprob] | None] | None = None
    timing: Timing | None = None  # once finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """This output and a later one of the same request as one (what a client that does not
        stream gets)."""

        def joined(a: list | None, b: list | None) -> list | None:
            return b if a is None else a if b is None else a + b

        return RequestOutput(
            rid=self.rid,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            finish_reason=later.finish_reason,
            prompt_tokens=later.prompt_tokens,
            completion_tokens=later.completion_tokens,
            cached_tokens=later.cached_tokens,
            logprobs=joined(self.logprobs, later.logprobs),
            top_logprobs=joined(self.top_logprobs, later.top_logprobs),
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
            prompt_top_logprobs=self.prompt_top_logprobs or later.prompt_top_logprobs,
            timing=later.timing,
        )


class _Msg(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Base of every IPC message; `tag=True` puts the class name on the wire."""


# --- tokenizer manager -> scheduler -------------------------------------------------------------


class TokenizedGenerateReqInput(_Msg):
    """A validated, tokenized request: what the scheduler turns into a `Req`."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    priority: int | None = None
    lora_name: str | None = None


class AbortReq(_Msg):
    """Stop a request (client gone, `/abort_request`, shutdown); `abort_all` stops every one."""

    rid: str = ""
    abort_all: bool = False
    message: str = "aborted"
    status_code: int = 499  # client closed request (nginx's convention)


class FlushCacheReq(_Msg):
    """Drop every cached prefix; only done while the scheduler is idle."""


class LoadLoraAdapterReq(_Msg):
    """Read a PEFT adapter directory and serve it under `name`."""

    req_id: str
    name: str
    path: str


class UnloadLoraAdapterReq(_Msg):
    """Stop serving adapter `name`: new requests for it are refused at once, and it is dropped
    (its cached prefixes with it) when its running and queued requests are done."""

    req_id: str
    name: str


ToScheduler = (
    TokenizedGenerateReqInput | AbortReq | FlushCacheReq | LoadLoraAdapterReq | UnloadLoraAdapterReq
)


# --- scheduler -> detokenizer -------------------------------------------------------------------


class FinishReason(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Why a request ended: `stop` (EOS, stop token or string), `length`, or `abort`."""

    type: Literal["stop", "length", "abort"]
    matched_token: int | None = None
    matched_str: str | None = None
    message: str | None = None
    status_code: int | None = None
    # The request field an abort blames, in /generate's names: set only for a refused grammar.
    param: str | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = (
                self.matched_str if self.matched_str is not None else self.matched_token
            )
        if self.message is not None:
            out["message"] = self.message
        if self.status_code is not None:
            out["status_code"] = self.status_code
        return out


# A top-logprobs entry is (logprob, token_id) pairs, best first.
TopLogprobs = list[tuple[float, int]]


class ReqOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's progress in one scheduler step: only what is new since its previous output.

    The scheduler fills in the tokens; the detokenizer adds their text. A streaming request gets
    one per step it advanced in; any other request gets one, when it finishes.
    """

    rid: str
    new_token_ids: list[int]
    text: str = ""  # the text of new_token_ids, UTF-8 safe and cut at a stop string
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far
    cached_tokens: int = 0
    # Logprobs of new_token_ids (None where not asked for); the prompt's are sent once.
    output_token_logprobs: list[float] | None = None
    output_top_logprobs: list[TopLogprobs] | None = None
    input_token_logprobs: list[float | None] | None = None
    input_top_logprobs: list[TopLogprobs | None] | None = None
    # time.time() stamps: queued in the scheduler, first scheduled, first token.
    queued_time: float = 0.0
    scheduled_time: float = 0.0
    first_token_time: float = 0.0
    # How the detokenizer renders the text.
    skip_special_tokens: bool = True
    stop_strs: list[str] = msgspec.field(default_factory=list)


class BatchOutput(_Msg):
    """Every request that advanced in one scheduler step: scheduler -> detokenizer (tokens),
    then detokenizer -> tokenizer manager (the same outputs with their text)."""

    outputs: list[ReqOutput]


# --- scheduler -> (detokenizer ->) tokenizer manager: heartbeat and control replies --------


class SchedulerStats(_Msg):
    """The scheduler's heartbeat: its load, sent every half second.

    It travels through the detokenizer, so a fresh heartbeat proves both loops are running.
    """

    time: float
    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int
    num_cached_tokens: int
    max_total_num_tokens: int
    gen_throughput: float  # output tokens/s over the last interval
    cache_hit_rate: float
    step_count: int
    generated_tokens: int = 0  # output tokens since start, running requests included
    spec_draft_tokens: int = 0  # speculative decoding: draft tokens proposed since start
    spec_accepted_tokens: int = 0  # ... and accepted
    # LoRA: the adapters in device slots, ready to run, and those queued requests wait for.
    lora_running: list[str] = msgspec.field(default_factory=list)
    lora_waiting: list[str] = msgspec.field(default_factory=list)


class SchedulerBusy(_Msg):
    """Sent straight to the API process by a thread of the scheduler while one step runs longer
    than a heartbeat interval: the heartbeat is late because the scheduler is working
    (`managers/engine_liveness.py`)."""

    step_s: float  # how long the running step has run


class FlushCacheOut(_Msg):
    success: bool
    message: str = ""


class LoraAdapterOut(_Msg):
    """The answer to a Load/UnloadLoraAdapterReq of the same `req_id`."""

    req_id: str
    success: bool
    message: str = ""
    status_code: int = 200


ToDetokenizer = BatchOutput | SchedulerStats
ToTokenizer = BatchOutput | SchedulerStats | SchedulerBusy | FlushCacheOut | LoraAdapterOut
