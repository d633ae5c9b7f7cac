"""OutputProcessor: after each step, take the sampled tokens in, decide who finished, pack what
advanced for the detokenizer, and keep the statistics the heartbeat reports."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from berth_runtime.io_struct import BatchOutput, FinishReason, ReqOutput
from berth_runtime.managers.schedule_batch import Req
from berth_runtime.model_executor.sampler import SampleOutput


@dataclass
class StepStats:
    """Counters the heartbeat reports."""

    step_count: int = 0
    generated_tokens: int = 0
    window_start: float = field(default_factory=time.monotonic)
    window_tokens: int = 0
    last_throughput: float = 0.0
    prompt_tokens: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    def throughput(self, idle: bool) -> float:
        """Output tokens/s since the last reading (the window restarts each second, or when
        idle)."""
        now = time.monotonic()
        elapsed = now - self.window_start
        if elapsed >= 1.0 or idle:
            self.last_throughput = self.window_tokens / elapsed if elapsed > 0 else 0.0
            self.window_start = now
            self.window_tokens = 0
        return self.last_throughput


class OutputProcessor:
    """Stop checks (EOS, stop token ids, stop strings, length, context) and the per-step output."""

    def __init__(
        self, eos_token_ids: set[int], decode: Callable[[list[int]], str], context_len: int
    ) -> None:
        self.eos_token_ids = eos_token_ids
        self.decode = decode
        self.context_len = context_len
        self.stats = StepStats()

    def take_sampled(self, reqs: list[Req], sampled: SampleOutput) -> None:
        """Append each request's new token (and logprobs), then check whether it finished."""
        now = time.time()
        for i, (req, token) in enumerate(zip(reqs, sampled.token_ids)):
            req.output_ids.append(token)
            if req.matcher is not None and not req.matcher.accept(token):
                # The mask allowed only what the grammar allows; a refusal means a bug, which
                # must end this request rather than let it continue outside its grammar.
                req.finished_reason = FinishReason(
                    "abort",
                    message=f"token {token} is outside the request's grammar",
                    status_code=500,
                )
                continue
            if not req.first_token_time:
                req.first_token_time = now
            logprob = sampled.logprobs[i]
            if logprob is not None:
                req.output_token_logprobs.append(logprob)
                top = sampled.top_logprobs[i]
                if top is not None:
                    req.output_top_logprobs.append(top)
            self.check_finished(req)
        self.stats.generated_tokens += len(reqs)
        self.stats.window_tokens += len(reqs)

    def take_accepted(self, req: Req, tokens: list[int]) -> int:
        """Append a verified run of greedy tokens (speculative decoding: no grammar, no
        logprobs), one at a time, until the request finishes; returns how many it took."""
        now = time.time()
        taken = 0
        for token in tokens:
            req.output_ids.append(token)
            taken += 1
            if not req.first_token_time:
                req.first_token_time = now
            self.check_finished(req)
            if req.finished:
                break
        self.stats.generated_tokens += taken
        self.stats.window_tokens += taken
        return taken

    def check_finished(self, req: Req) -> None:
        params = req.sampling_params
        token = req.output_ids[-1]
        num_out = len(req.output_ids)
        if req.matcher is not None and req.matcher.finished:
            # The grammar is complete and its stop token taken, even with ignore_eos.
            req.finished_reason = FinishReason("stop", matched_token=token)
            return
        if num_out >= params.min_new_tokens:
            if token in params.stop_token_ids or (
                not params.ignore_eos and token in self.eos_token_ids
            ):
                req.finished_reason = FinishReason("stop", matched_token=token)
                return
            if params.stop:
                # A stop string can only have been completed by the newest tokens.
                tail = self.decode(req.output_ids[-(req.max_stop_str_len + 4) :])
                for stop in params.stop:
                    if stop in tail:
                        req.finished_reason = FinishReason("stop", matched_str=stop)
                        return
        if num_out >= req.max_new_tokens or req.fill_len >= self.context_len:
            req.finished_reason = FinishReason("length")

    def make_output(self, reqs: list[Req]) -> BatchOutput | None:
        """What each request gained since its last output: new token ids, their logprobs, and
        its finish reason once it has one. A request that does not stream is sent once, when it
        finishes (nothing would read its partial outputs); None when nothing is to be sent."""
        outputs = [self._req_output(req) for req in reqs if req.stream or req.finished]
        return BatchOutput(outputs=outputs) if outputs else None

    @staticmethod
    def _req_output(req: Req) -> ReqOutput:
        start = req.sent_len
        req.sent_len = len(req.output_ids)
        out = ReqOutput(
            rid=req.rid,
            new_token_ids=req.output_ids[start:],
            finish_reason=req.finished_reason,
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            queued_time=req.queued_time,
            scheduled_time=req.scheduled_time,
            first_token_time=req.first_token_time,
            skip_special_tokens=req.sampling_params.skip_special_tokens,
            stop_strs=req.sampling_params.stop,
        )
        if req.return_logprob:
            out.output_token_logprobs = req.output_token_logprobs[start:]
            if req.top_logprobs_num:
                out.output_top_logprobs = req.output_top_logprobs[start:]
        send_prompt = req.return_prompt_logprobs and not req.prompt_logprobs_sent
        if send_prompt and (req.output_ids or req.finished):
            req.prompt_logprobs_sent = True
            out.input_token_logprobs = req.input_token_logprobs
            if req.top_logprobs_num:
                out.input_top_logprobs = req.input_top_logprobs
        return out
