"""Scheduler: admit requests, batch them continuously, run the model, and report new tokens."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from berth_runtime.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FinishReason,
    FlushCacheOut,
    FlushCacheReq,
    SchedulerStats,
    TokenizedGenerateReqInput,
)
from berth_runtime.managers.schedule_batch import Req
from berth_runtime.mem_cache.radix_cache import RadixCache
from berth_runtime.model_executor.forward_batch import ForwardBatch
from berth_runtime.model_executor.sampler import SamplingBatchInfo, apply_penalties, sample
from berth_runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Decode tokens of each running request assumed when admitting new ones (capped per request), as a
# fraction of what it may still generate: a guess that keeps retraction rare without idling memory.
RESERVE_TOKENS_CAP = 256
RESERVE_RATIO = 0.5
# Longest-prefix-match ordering costs a tree walk per waiting request; beyond this queue length the
# scheduler falls back to FCFS (as SGLang does).
LPM_MAX_QUEUE = 128


@dataclass
class StepStats:
    """Counters the heartbeat reports."""

    step_count: int = 0
    generated_tokens: int = 0
    window_start: float = field(default_factory=time.monotonic)
    window_tokens: int = 0
    last_throughput: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class ExtendEntry:
    """A slice [start, end) of a request's tokens prefilled in one step."""

    req: Req
    start: int
    end: int


class Scheduler:
    """Continuous batching over a ModelRunner; owns every `Req` from arrival to finish.

    `step()` is one unit of work: schedule a prefill (extend) or a decode batch, run it, and return
    the outputs to send. Requests join between steps and leave as soon as they finish.
    """

    def __init__(
        self,
        args: ServerArgs,
        runner,
        *,
        eos_token_ids: set[int],
        decode: Callable[[list[int]], str],
    ) -> None:
        self.args = args
        self.runner = runner
        self.kv_pool = runner.kv_pool
        self.req_to_token = runner.req_to_token_pool
        self.device = runner.device
        self.vocab_size = runner.vocab_size
        self.context_len = runner.context_len
        self.max_total_tokens = self.kv_pool.size
        self.eos_token_ids = eos_token_ids
        self.decode = decode
        self.max_running = min(args.max_running_requests, self.req_to_token.max_reqs)
        self.prefill_budget = (
            args.chunked_prefill_size if args.chunked_prefill_size > 0 else args.max_prefill_tokens
        )
        self.chunking = args.chunked_prefill_size > 0

        self.tree = None if args.disable_radix_cache else RadixCache(self.kv_pool.free)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.last_step_was_prefill = False
        self.finished_unsent: list[Req] = []  # finished outside a step (aborted, rejected)
        self.stats = StepStats()

    # --- inputs ------------------------------------------------------------------------------

    def handle_generate(self, msg: TokenizedGenerateReqInput) -> None:
        prompt_len = len(msg.input_ids)
        room = min(self.context_len, self.max_total_tokens) - prompt_len
        max_new = msg.sampling_params.max_new_tokens
        max_new = room if max_new is None else min(max_new, room)
        req = Req.from_tokenized(msg, max_new)
        if room <= 0 or prompt_len == 0:
            self._finish_abort(req, f"prompt of {prompt_len} tokens does not fit", 400)
            return
        if max_new == 0 and not req.return_prompt_logprobs:
            req.finished_reason = FinishReason("length")
            self.finished_unsent.append(req)
            return
        limit = self.args.max_queued_requests
        if limit is not None and self._num_queued() >= limit:
            self._finish_abort(req, f"too many queued requests ({limit}); retry later", 503)
            return
        self.waiting.append(req)

    def _num_queued(self) -> int:
        """Waiting requests that free batch slots will not take at the next step."""
        num_live = len(self.running) + (1 if self.chunked_req else 0)
        return len(self.waiting) - max(0, self.max_running - num_live)

    def handle_abort(self, msg: AbortReq) -> None:
        for req in self._all_live_reqs():
            if msg.abort_all or req.rid == msg.rid:
                self._finish_abort(req, msg.message, msg.status_code)

    def handle_flush_cache(self, _: FlushCacheReq) -> FlushCacheOut:
        if self.running or self.waiting or self.chunked_req:
            return FlushCacheOut(success=False, message="the scheduler is busy; retry when idle")
        if self.tree is not None:
            self.tree.reset()
        self.kv_pool.clear()
        self.req_to_token.clear()
        return FlushCacheOut(success=True)

    def _all_live_reqs(self) -> list[Req]:
        reqs = self.waiting + self.running
        if self.chunked_req is not None and self.chunked_req not in reqs:
            reqs.append(self.chunked_req)
        return reqs

    def _finish_abort(self, req: Req, message: str, status_code: int) -> None:
        req.finished_reason = FinishReason("abort", message=message, status_code=status_code)
        self._release(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None
        self.finished_unsent.append(req)

    # --- the step ----------------------------------------------------------------------------

    @property
    def is_idle(self) -> bool:
        return not (self.waiting or self.running or self.chunked_req or self.finished_unsent)

    def step(self) -> BatchTokenIDOut | None:
        """Run one batch; return what advanced (None when there was nothing to do)."""
        advanced: list[Req] = self.finished_unsent
        self.finished_unsent = []
        # Alternate with decode while a long prompt is being chunked, so streams keep flowing.
        prefill_first = not (self.last_step_was_prefill and self.running)
        entries = self._schedule_extend() if prefill_first else []
        if entries:
            advanced += self._run_extend(entries)
            self.last_step_was_prefill = True
        elif self.running:
            advanced += self._run_decode()
            self.last_step_was_prefill = False
        else:
            self.last_step_was_prefill = False
        if advanced:
            self.stats.step_count += 1
        return self._make_output(advanced) if advanced else None

    def _schedule_extend(self) -> list[ExtendEntry]:
        budget = self.prefill_budget
        entries: list[ExtendEntry] = []
        reserved = sum(self._reserve(r) for r in self.running)
        candidates = ([self.chunked_req] if self.chunked_req else []) + self._ordered_waiting()
        num_live = len(self.running) + (1 if self.chunked_req else 0)
        for req in candidates:
            is_new = req is not self.chunked_req
            if is_new and num_live >= self.max_running:
                victim = self._preemption_victim(req)
                if victim is None:
                    break
                reserved -= self._reserve(victim)
                self._preempt(victim, req)
                num_live -= 1
            if req.req_row is None and not self._admit_with_prefix(req):
                break
            remaining = req.fill_len - req.kv_len
            chunk = min(remaining, budget)
            if chunk < remaining and not self.chunking and not entries:
                chunk = remaining  # chunking disabled: a long prompt runs alone, whole
            if chunk <= 0 or (chunk < remaining and not self.chunking):
                break
            reserve = self._reserve(req) if chunk == remaining else 0
            need = chunk + reserved + reserve
            if need > self._free_capacity() and self._can_preempt_for(req, need):
                while need > self._free_capacity():
                    victim = self._preemption_victim(req)
                    assert victim is not None, "_can_preempt_for counted the victims"
                    reserved -= self._reserve(victim)
                    need -= self._reserve(victim)
                    self._preempt(victim, req)
                    num_live -= 1
            if chunk + reserved + reserve > self._free_capacity():
                if entries or self.running:
                    self._undo_admission(req)
                    break  # wait for memory to be freed by running requests
                chunk = min(chunk, self._free_capacity())  # run what fits
                if chunk <= 0 or (chunk < remaining and not self.chunking):
                    self._undo_admission(req)
                    break
            if is_new:
                self.waiting.remove(req)
                num_live += 1
            if not req.scheduled_time:
                req.scheduled_time = time.time()
            entries.append(ExtendEntry(req, req.kv_len, req.kv_len + chunk))
            budget -= chunk
            reserved += reserve
            if chunk < remaining:
                self.chunked_req = req
                break
            if req is self.chunked_req:
                self.chunked_req = None
            if budget <= 0:
                break
        return entries

    def _ordered_waiting(self) -> list[Req]:
        policy = self.args.schedule_policy
        if policy == "priority":
            return sorted(self.waiting, key=lambda r: (-r.priority, r.queued_time))
        if policy == "lpm" and self.tree is not None and len(self.waiting) <= LPM_MAX_QUEUE:
            matched = {
                id(r): len(self.tree.match_prefix(r.fill_ids(0, r.fill_len))[0])
                for r in self.waiting
            }
            return sorted(self.waiting, key=lambda r: -matched[id(r)])  # stable: FCFS on ties
        return list(self.waiting)

    def _preemption_victim(self, req: Req) -> Req | None:
        """Priority policy: the running request `req` may displace, if any.

        The lowest-priority one (the newest among equals), and only if its priority is strictly
        lower than `req`'s: equal priorities never preempt each other, so nothing thrashes.
        """
        if self.args.schedule_policy != "priority":
            return None
        lower = [r for r in self.running if r.priority < req.priority]
        return min(lower, key=lambda r: (r.priority, -r.queued_time)) if lower else None

    def _can_preempt_for(self, req: Req, need: int) -> bool:
        """Whether preempting every lower-priority running request could free `need` tokens.

        Counted generously (a victim's whole KV and its reserve), so nothing is preempted for a
        request that would still not fit.
        """
        if self.args.schedule_policy != "priority":
            return False
        lower = [r for r in self.running if r.priority < req.priority]
        if not lower:
            return False
        gain = sum(r.kv_len + self._reserve(r) for r in lower)
        return need <= self._free_capacity() + gain

    def _preempt(self, victim: Req, by: Req) -> None:
        """Push a running request back to the queue for a higher-priority one.

        As with retraction, its output so far is kept and it is prefilled again (prompt + output)
        when it is admitted again; its stream continues where it stopped.
        """
        self.running.remove(victim)
        self._release(victim)
        self.waiting.insert(0, victim)
        logger.info(
            "preempted %s (priority %d, %d tokens kept) for %s (priority %d)",
            victim.rid,
            victim.priority,
            len(victim.output_ids),
            by.rid,
            by.priority,
        )

    def _admit_with_prefix(self, req: Req) -> bool:
        """Give `req` a table row and its longest cached prefix (locked); False if no row."""
        row = self.req_to_token.alloc()
        if row is None:
            return False
        req.req_row = row
        if self.tree is None or req.return_prompt_logprobs:
            return True  # prompt logprobs need every prompt position computed
        # Leave at least one token to run: its logits give the next token.
        slots, node = self.tree.match_prefix(req.fill_ids(0, req.fill_len - 1))
        n = len(slots)
        if n:
            self.req_to_token.req_to_token[row, :n] = slots
        self.tree.lock(node)
        req.last_node = node
        req.kv_len = req.prefix_len = req.exact_len = n
        if not req.output_ids and not req.scheduled_time:
            req.cached_tokens = n  # first admission: what the client sees as cached
            self.stats.cached_tokens += n
        return True

    def _undo_admission(self, req: Req) -> None:
        """Admission failed after the prefix was taken: give the row and the lock back."""
        if req is self.chunked_req or req.req_row is None or req.kv_len != req.prefix_len:
            return
        if self.tree is not None and req.last_node is not None:
            self.tree.unlock(req.last_node)
        if not req.output_ids and not req.scheduled_time:
            self.stats.cached_tokens -= req.cached_tokens
            req.cached_tokens = 0
        self.req_to_token.free(req.req_row)
        req.req_row, req.last_node = None, None
        req.kv_len = req.prefix_len = req.exact_len = 0

    def _free_capacity(self) -> int:
        """Slots that can be had now: free ones plus unlocked cache entries."""
        evictable = self.tree.evictable_size if self.tree is not None else 0
        return self.kv_pool.available_size() + evictable

    def _ensure_free(self, need: int) -> None:
        short = need - self.kv_pool.available_size()
        if short > 0 and self.tree is not None:
            self.tree.evict(short)

    @staticmethod
    def _reserve(req: Req) -> int:
        return int(min(req.remaining_new_tokens, RESERVE_TOKENS_CAP) * RESERVE_RATIO)

    def _run_extend(self, entries: list[ExtendEntry]) -> list[Req]:
        total = sum(e.end - e.start for e in entries)
        self._ensure_free(total)
        slots = self.kv_pool.alloc(total)
        assert slots is not None, "admission checked the pool"
        table = self.req_to_token.req_to_token
        input_ids: list[int] = []
        offset = 0
        for e in entries:
            n = e.end - e.start
            table[e.req.req_row, e.start : e.end] = slots[offset : offset + n]
            input_ids += e.req.fill_ids(e.start, e.end)
            offset += n
        batch = ForwardBatch.extend(
            input_ids,
            [e.start for e in entries],
            [e.end - e.start for e in entries],
            slots,
            [e.req.req_row for e in entries],
            table,
            self.device,
        )
        hidden = self.runner.forward(batch)

        row_start = 0
        for e in entries:
            e.req.kv_len = e.req.exact_len = e.end
            if e.req.return_prompt_logprobs:
                rows = hidden[row_start : row_start + (e.end - e.start)]
                self._add_prompt_logprobs(e.req, e.start, e.end, rows)
            row_start += e.end - e.start
        done = [i for i, e in enumerate(entries) if e.end == e.req.fill_len]
        for i in [i for i in done if entries[i].req.max_new_tokens == 0]:
            # Prompt scoring only (echo + logprobs, max_tokens=0): finish without sampling.
            entries[i].req.finished_reason = FinishReason("length")
            self._release(entries[i].req)
        scored = [entries[i].req for i in done if entries[i].req.finished]
        done = [i for i in done if not entries[i].req.finished]
        if not done:
            return scored
        reqs = [entries[i].req for i in done]
        for req in reqs:
            self._cache_prefilled(req)
        self.stats.prompt_tokens += sum(len(r.origin_input_ids) for r in reqs if not r.output_ids)
        logits = self.runner.compute_logits(hidden[batch.last_token_index[done]])
        self._sample_and_finish(reqs, logits)
        for req in reqs:
            if not req.finished:
                self.running.append(req)
        return scored + reqs

    def _run_decode(self) -> list[Req]:
        self._retract_until_fits(len(self.running))
        reqs = self.running
        slots = self.kv_pool.alloc(len(reqs))
        assert slots is not None, "retraction made room"
        rows = [r.req_row for r in reqs]
        positions = [r.kv_len for r in reqs]
        table = self.req_to_token.req_to_token
        table[torch.tensor(rows), torch.tensor(positions)] = slots
        batch = ForwardBatch.decode(
            [r.output_ids[-1] for r in reqs],
            positions,
            slots,
            rows,
            table,
            self.device,
        )
        hidden = self.runner.forward(batch)
        exact = self.runner.decode_matches_prefill(len(reqs))
        for r in reqs:
            if exact and r.exact_len == r.kv_len:
                r.exact_len += 1
            r.kv_len += 1
        logits = self.runner.compute_logits(hidden)
        advanced = list(reqs)
        self._sample_and_finish(advanced, logits)
        self.running = [r for r in reqs if not r.finished]
        return advanced

    def _retract_until_fits(self, need: int) -> None:
        """Out of KV memory: push the newest, lowest-priority requests back to the queue.

        Their output so far is kept; they are prefilled again (prompt + output) when memory frees.
        """
        self._ensure_free(need)
        while self.kv_pool.available_size() < need and len(self.running) > 1:
            victim = min(self.running, key=lambda r: (r.priority, -r.queued_time))
            self.running.remove(victim)
            self._release(victim)
            self.waiting.insert(0, victim)
            need -= 1
            self._ensure_free(need)
            logger.info(
                "KV cache full: retracted %s (%d tokens kept)", victim.rid, len(victim.output_ids)
            )

    def _cache_prefilled(self, req: Req) -> None:
        """Share a request's prompt with later requests as soon as it is prefilled, not only
        when it finishes (SGLang's cache_unfinished_req): concurrent requests with a common
        prefix then reuse it."""
        if self.tree is None or req.req_row is None or req.kv_len == req.prefix_len:
            return
        table = self.req_to_token.req_to_token
        key = req.fill_ids(0, req.kv_len)
        slots = table[req.req_row, : req.kv_len].clone()
        cached = self.tree.insert(key, slots)
        self.kv_pool.free(slots[req.prefix_len : cached])  # duplicates of what was cached
        tree_slots, node = self.tree.match_prefix(key)
        table[req.req_row, : req.kv_len] = tree_slots
        if req.last_node is not None:
            self.tree.unlock(req.last_node)
        self.tree.lock(node)
        req.last_node = node
        req.prefix_len = req.kv_len

    def _release(self, req: Req) -> None:
        """Give a request's table row back; its KV goes into the radix cache (or is freed).

        Only K/V that a prefill of the same tokens would compute bit for bit are cached
        (`exact_len`): a later request that reuses them then gets the answer it would get
        without the cache. K/V written by decode steps whose weights or kernels differ from
        the prefill's (the 4-bit GGUF weights of small CPU batches, or torch_native attention)
        are freed, and a conversation's next turn computes its previous answer again."""
        if req.req_row is None:
            return
        slots = self.req_to_token.req_to_token[req.req_row, : req.kv_len].clone()
        if self.tree is None:
            self.kv_pool.free(slots)
        else:
            # Tokens the cache already holds (inserted by another request meanwhile) are
            # duplicates: free our copies. The rest of the exact part now belongs to the cache.
            cached = self.tree.insert(req.fill_ids(0, req.exact_len), slots[: req.exact_len])
            self.kv_pool.free(slots[req.prefix_len : cached])
            self.kv_pool.free(slots[req.exact_len :])
            if req.last_node is not None:
                self.tree.unlock(req.last_node)
        self.req_to_token.free(req.req_row)
        req.req_row, req.last_node = None, None
        req.kv_len = req.prefix_len = req.exact_len = 0

    # --- sampling and finishing --------------------------------------------------------------

    def _sample_and_finish(self, reqs: list[Req], logits: torch.Tensor) -> None:
        raw_logprobs = None
        if all(self._plain_greedy(r) for r in reqs):
            # max().indices, like argmax, takes the first maximum (and is faster).
            next_ids = logits.max(dim=-1).indices.tolist()
        else:
            if any(r.return_logprob for r in reqs):
                raw_logprobs = torch.log_softmax(logits, dim=-1)
            self._process_logits(reqs, logits)
            infos = SamplingBatchInfo.build(
                [r.sampling_params for r in reqs],
                [r.generator for r in reqs],
                self.vocab_size,
                self.device,
            )
            next_ids = sample(logits, infos).tolist()
        now = time.time()
        for i, (req, token) in enumerate(zip(reqs, next_ids)):
            req.output_ids.append(token)
            if not req.first_token_time:
                req.first_token_time = now
            if raw_logprobs is not None and req.return_logprob:
                req.output_token_logprobs.append(float(raw_logprobs[i, token]))
                if req.top_logprobs_num:
                    req.output_top_logprobs.append(_top(raw_logprobs[i], req.top_logprobs_num))
            self._check_finished(req)
            if req.finished:
                self._release(req)
        self.stats.generated_tokens += len(reqs)
        self.stats.window_tokens += len(reqs)

    @staticmethod
    def _plain_greedy(req: Req) -> bool:
        """Greedy with nothing that reads or changes the logits (logprobs, bias, penalties,
        min_tokens)."""
        params = req.sampling_params
        return (
            params.is_greedy
            and not req.return_logprob
            and not params.logit_bias
            and not params.has_penalties
            and len(req.output_ids) >= params.min_new_tokens
        )

    def _process_logits(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Logit bias, penalties and min_tokens, only for the rows that ask for them."""
        for i, req in enumerate(reqs):
            params = req.sampling_params
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias), device=logits.device)
                bias = torch.tensor(list(params.logit_bias.values()), device=logits.device)
                logits[i, ids] += bias
            if params.has_penalties:
                apply_penalties(logits, i, params, req.output_ids, req.origin_input_ids)
            if len(req.output_ids) < params.min_new_tokens:
                banned = set(params.stop_token_ids)
                if not params.ignore_eos:
                    banned |= self.eos_token_ids
                if banned:
                    logits[i, list(banned)] = float("-inf")

    def _check_finished(self, req: Req) -> None:
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

    def _add_prompt_logprobs(self, req: Req, start: int, end: int, hidden: torch.Tensor) -> None:
        """Logprob of each prompt token given the ones before it (the first has none)."""
        prompt = req.origin_input_ids
        if start == 0:
            req.input_token_logprobs.append(None)
            req.input_top_logprobs.append(None)
        logprobs = torch.log_softmax(self.runner.compute_logits(hidden), dim=-1)
        for offset in range(end - start):
            pos = start + offset + 1  # the token this position predicts
            if pos >= len(prompt):
                break
            req.input_token_logprobs.append(float(logprobs[offset, prompt[pos]]))
            if req.top_logprobs_num:
                req.input_top_logprobs.append(_top(logprobs[offset], req.top_logprobs_num))

    # --- outputs -----------------------------------------------------------------------------

    def _make_output(self, reqs: list[Req]) -> BatchTokenIDOut:
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

    def get_stats(self) -> SchedulerStats:
        now = time.monotonic()
        elapsed = now - self.stats.window_start
        if elapsed >= 1.0 or self.is_idle:
            self.stats.last_throughput = self.stats.window_tokens / elapsed if elapsed > 0 else 0.0
            self.stats.window_start = now
            self.stats.window_tokens = 0
        cached = self.tree.total_size if self.tree is not None else 0
        evictable = self.tree.evictable_size if self.tree is not None else 0
        # As in SGLang, cached KV that no request holds is not "used": it can be evicted.
        used = self.max_total_tokens - self.kv_pool.available_size() - evictable
        return SchedulerStats(
            time=time.time(),
            num_running_reqs=len(self.running) + (1 if self.chunked_req else 0),
            num_waiting_reqs=len(self.waiting),
            num_used_tokens=used,
            num_cached_tokens=cached,
            max_total_num_tokens=self.max_total_tokens,
            gen_throughput=self.stats.last_throughput,
            cache_hit_rate=(
                self.stats.cached_tokens / self.stats.prompt_tokens
                if self.stats.prompt_tokens
                else 0.0
            ),
            step_count=self.stats.step_count,
            generated_tokens=self.stats.generated_tokens,
        )


def _top(logprobs: torch.Tensor, k: int) -> list[tuple[float, int]]:
    values, ids = torch.topk(logprobs, k)
    return list(zip(values.tolist(), ids.tolist()))
