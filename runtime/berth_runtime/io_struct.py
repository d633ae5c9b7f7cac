"""Every message that crosses a process boundary, plus the API-side GenerateReqInput.

Naming follows SGLang: `*ReqInput` goes into the engine, `*Out` comes out of it, `Batch*`
carries one entry per request of a scheduler step. Wire structs are tagged msgspec structs, so
a socket decodes exactly its own union and rejects anything else. No torch here: token ids
travel as lists.
"""

from __future__ import annotations

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
    # Routing signals: carried along the chain even though one server is one DP rank.
    routed_dp_rank: int | None = None
    priority: int | None = None
    routing_key: str | None = None
    # False for internal probes (/health_generate): they do not count in the metrics.
    log_metrics: bool = True


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
    routed_dp_rank: int | None = None
    priority: int | None = None
    routing_key: str | None = None
    received_time: float = 0.0  # time.time() when the API received the request
    tokenized_time: float = 0.0


class AbortReq(_Msg):
    """Stop a request (client gone, `/abort_request`, shutdown); `abort_all` stops every one."""

    rid: str = ""
    abort_all: bool = False
    message: str = "aborted"
    status_code: int = 499  # client closed request (nginx's convention)


class FlushCacheReq(_Msg):
    """Drop every cached prefix; only done while the scheduler is idle."""


ToScheduler = TokenizedGenerateReqInput | AbortReq | FlushCacheReq


# --- scheduler -> detokenizer -------------------------------------------------------------------


class FinishReason(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Why a request ended: `stop` (EOS, stop token or string), `length`, or `abort`."""

    type: str
    matched_token: int | None = None
    matched_str: str | None = None
    message: str | None = None
    status_code: int | None = None

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


class BatchTokenIDOut(_Msg):
    """New token ids of the requests that advanced in one scheduler step (one entry per rid)."""

    rids: list[str]
    new_token_ids: list[list[int]]
    finished_reasons: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    # How the detokenizer must render each rid's text.
    skip_special_tokens: list[bool]
    stop_strs: list[list[str]]
    # Logprobs of the new tokens (None where not requested).
    output_token_logprobs: list[list[float] | None]
    output_top_logprobs: list[list[TopLogprobs] | None]
    # Prompt logprobs, sent once with the first output (None where not requested).
    input_token_logprobs: list[list[float | None] | None]
    input_top_logprobs: list[list[TopLogprobs | None] | None]
    # Per-request time stamps (time.time()): queued in the scheduler, first scheduled, first token.
    queued_times: list[float]
    scheduled_times: list[float]
    first_token_times: list[float]


# --- detokenizer -> tokenizer manager -----------------------------------------------------------


class BatchStrOut(_Msg):
    """New text (and the token ids behind it) of the requests that advanced in one step."""

    rids: list[str]
    output_strs: list[str]  # text delta since the previous BatchStrOut of that rid
    new_token_ids: list[list[int]]
    finished_reasons: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_token_logprobs: list[list[float] | None]
    output_top_logprobs: list[list[TopLogprobs] | None]
    input_token_logprobs: list[list[float | None] | None]
    input_top_logprobs: list[list[TopLogprobs | None] | None]
    queued_times: list[float]
    scheduled_times: list[float]
    first_token_times: list[float]


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


class FlushCacheOut(_Msg):
    success: bool
    message: str = ""


ToDetokenizer = BatchTokenIDOut | SchedulerStats
ToTokenizer = BatchStrOut | SchedulerStats | FlushCacheOut
