"""OutputProcessor: after each step, take the sampled tokens in, decide who finished, pack what
advanced for the detokenizer, and keep the statistics the heartbeat reports."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from berth_runtime.io_struct import BatchTokenIDOut, FinishReason
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

    def check_finished(self, req: Req) -> None:
        params = req.sampling_params
        token = req.output_ids[-1]
        num_out = len(req.output_ids)
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

    def make_output(self, reqs: list[Req]) -> BatchTokenIDOut:
        """What each request gained since its last output: new token ids, logprobs, and its
        finish reason once it has one."""
        out = BatchTokenIDOut(
            rids=[],
            new_token_ids=[],
            finished_reasons=[],
            prompt_tokens=[],
            completion_tokens=[],
            cached_tokens=[],
            skip_special_tokens=[],
            stop_strs=[],
            output_token_logprobs=[],
            output_top_logprobs=[],
            input_token_logprobs=[],
            input_top_logprobs=[],
            queued_times=[],
            scheduled_times=[],
            first_token_times=[],
        )
        for req in reqs:
            start = req.sent_len
            req.sent_len = len(req.output_ids)
            out.rids.append(req.rid)
            out.new_token_ids.append(req.output_ids[start:])
            out.finished_reasons.append(req.finished_reason)
            out.prompt_tokens.append(len(req.origin_input_ids))
            out.completion_tokens.append(len(req.output_ids))
            out.cached_tokens.append(req.cached_tokens)
            out.skip_special_tokens.append(req.sampling_params.skip_special_tokens)
            out.stop_strs.append(req.sampling_params.stop)
            if req.return_logprob:
                out.output_token_logprobs.append(req.output_token_logprobs[start:])
                out.output_top_logprobs.append(
                    req.output_top_logprobs[start:] if req.top_logprobs_num else None
                )
            else:
                out.output_token_logprobs.append(None)
                out.output_top_logprobs.append(None)
            send_prompt = req.return_prompt_logprobs and not req.prompt_logprobs_sent
            send_prompt = send_prompt and (bool(req.output_ids) or req.finished)
            if send_prompt:
                req.prompt_logprobs_sent = True
                out.input_token_logprobs.append(req.input_token_logprobs)
                out.input_top_logprobs.append(
                    req.input_top_logprobs if req.top_logprobs_num else None
                )
            else:
                out.input_token_logprobs.append(None)
                out.input_top_logprobs.append(None)
            out.queued_times.append(req.queued_time)
            out.scheduled_times.append(req.scheduled_time)
            out.first_token_times.append(req.first_token_time)
        return out
