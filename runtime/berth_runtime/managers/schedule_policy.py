"""SchedulePolicy: what the next step runs: the queues, admission, chunking and preemption."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from berth_runtime.managers.schedule_batch import Req
from berth_runtime.mem_cache.kv_manager import KVManager
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
class ExtendEntry:
    """A slice [start, end) of a request's tokens prefilled in one step; `completes` when it is
    the last slice, after which the request samples its next token."""

    req: Req
    start: int
    end: int
    completes: bool


@dataclass
class ExtendBatch:
    """A prefill step: new prompt tokens (or a whole chunk of one) for each entry."""

    entries: list[ExtendEntry]


@dataclass
class DecodeBatch:
    """A decode step: one new token for each running request."""

    reqs: list[Req]


BatchPlan = ExtendBatch | DecodeBatch


class SchedulePolicy:
    """Owns the waiting and running queues and picks each step's batch.

    A prefill step takes waiting requests in policy order (`fcfs`, `priority`, `lpm`) while the
    prefill budget, the batch slots and KV memory allow, chunking a long prompt; a request being
    chunked alternates with decode steps so streams keep flowing. With `priority`, a waiting
    request may preempt running ones of strictly lower priority. When decode runs out of KV
    memory, the newest lowest-priority requests are retracted to the queue, output kept.
    """

    def __init__(self, args: ServerArgs, kv: KVManager, max_running: int) -> None:
        self.args = args
        self.kv = kv
        self.max_running = max_running
        self.prefill_budget = (
            args.chunked_prefill_size if args.chunked_prefill_size > 0 else args.max_prefill_tokens
        )
        self.chunking = args.chunked_prefill_size > 0
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.last_step_was_prefill = False
        self.cached_tokens = 0  # prompt tokens served from the cache, for the hit rate
        # With LoRA: whether a request for an adapter may join requests using others (one batch
        # mixes at most --max-loras-per-batch adapters); set by the scheduler.
        self.adapter_may_join: Callable[[str | None, set[str]], bool] | None = None

    # --- queues ------------------------------------------------------------------------------

    @property
    def num_live(self) -> int:
        """Requests holding a batch slot: running, or being chunked."""
        return len(self.running) + (1 if self.chunked_req else 0)

    def num_queued(self) -> int:
        """Waiting requests that free batch slots will not take at the next step."""
        return len(self.waiting) - max(0, self.max_running - self.num_live)

    def live_reqs(self) -> list[Req]:
        reqs = self.waiting + self.running
        if self.chunked_req is not None and self.chunked_req not in reqs:
            reqs.append(self.chunked_req)
        return reqs

    def remove(self, req: Req) -> None:
        """Forget a request that finished outside a step (aborted)."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None

    def is_busy(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req)

    # --- the next batch ----------------------------------------------------------------------

    def next_batch(self) -> BatchPlan | None:
        """The next step's batch, or None when there is nothing to run."""
        prefill_first = not (self.last_step_was_prefill and self.running)
        entries = self._schedule_extend() if prefill_first else []
        self.last_step_was_prefill = bool(entries)
        if entries:
            return ExtendBatch(entries)
        if not self.running:
            return None
        self._retract_until_fits(len(self.running))
        return DecodeBatch(list(self.running))

    def settle(self, batch: BatchPlan) -> None:
        """After a step: prefilled requests that go on decoding join the running batch, and
        finished ones leave it."""
        if isinstance(batch, ExtendBatch):
            for e in batch.entries:
                if e.completes and not e.req.finished:
                    self.running.append(e.req)
        else:
            self.running = [r for r in batch.reqs if not r.finished]

    def _schedule_extend(self) -> list[ExtendEntry]:
        budget = self.prefill_budget
        entries: list[ExtendEntry] = []
        reserved = sum(self.reserve(r) for r in self.running)
        candidates = ([self.chunked_req] if self.chunked_req else []) + self._ordered_waiting()
        num_live = self.num_live
        for req in candidates:
            is_new = req is not self.chunked_req
            if is_new and not self._adapter_fits(req, entries):
                continue  # its adapter waits for a slot; later requests may still run
            if is_new and num_live >= self.max_running:
                victim = self._preemption_victim(req)
                if victim is None:
                    break
                reserved -= self.reserve(victim)
                self._preempt(victim, req)
                num_live -= 1
            if req.req_row is None and not self._admit(req):
                break
            remaining = req.fill_len - req.kv_len
            chunk = min(remaining, budget)
            if chunk < remaining and not self.chunking and not entries:
                chunk = remaining  # chunking disabled: a long prompt runs alone, whole
            if chunk <= 0 or (chunk < remaining and not self.chunking):
                break
            reserve = self.reserve(req) if chunk == remaining else 0
            need = chunk + reserved + reserve
            if need > self.kv.free_capacity() and self._can_preempt_for(req, need):
                while need > self.kv.free_capacity():
                    victim = self._preemption_victim(req)
                    assert victim is not None, "_can_preempt_for counted the victims"
                    reserved -= self.reserve(victim)
                    need -= self.reserve(victim)
                    self._preempt(victim, req)
                    num_live -= 1
            if chunk + reserved + reserve > self.kv.free_capacity():
                if entries or self.running:
                    self._undo_admission(req)
                    break  # wait for memory to be freed by running requests
                chunk = min(chunk, self.kv.free_capacity())  # run what fits
                if chunk <= 0 or (chunk < remaining and not self.chunking):
                    self._undo_admission(req)
                    break
            if is_new:
                self.waiting.remove(req)
                num_live += 1
            if not req.scheduled_time:
                req.scheduled_time = time.time()
            entries.append(ExtendEntry(req, req.kv_len, req.kv_len + chunk, chunk == remaining))
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

    def live_adapters(self) -> set[str]:
        """The adapters of the requests holding a batch slot."""
        live = [*self.running, *([self.chunked_req] if self.chunked_req else [])]
        return {r.lora_name for r in live if r.lora_name is not None}

    def _adapter_fits(self, req: Req, entries: list[ExtendEntry]) -> bool:
        if self.adapter_may_join is None or req.lora_name is None:
            return True
        live = self.live_adapters() | {e.req.lora_name for e in entries if e.req.lora_name}
        return self.adapter_may_join(req.lora_name, live)

    def _ordered_waiting(self) -> list[Req]:
        policy = self.args.schedule_policy
        if policy == "priority":
            return sorted(self.waiting, key=lambda r: (-r.priority, r.queued_time))
        if policy == "lpm" and self.kv.tree is not None and len(self.waiting) <= LPM_MAX_QUEUE:
            matched = {
                id(r): self.kv.cached_prefix_len(r.fill_ids(0, r.fill_len), r.lora_namespace)
                for r in self.waiting
            }
            return sorted(self.waiting, key=lambda r: -matched[id(r)])  # stable: FCFS on ties
        return list(self.waiting)

    # --- admission ---------------------------------------------------------------------------

    def _admit(self, req: Req) -> bool:
        if not self.kv.admit(req):
            return False
        if not req.output_ids and not req.scheduled_time:
            req.cached_tokens = req.prefix_len  # first admission: what the client sees as cached
            self.cached_tokens += req.prefix_len
        return True

    def _undo_admission(self, req: Req) -> None:
        """Admission failed after the prefix was taken (never for a request mid-prefill)."""
        if req is self.chunked_req or req.req_row is None or req.kv_len != req.prefix_len:
            return
        if not req.output_ids and not req.scheduled_time:
            self.cached_tokens -= req.cached_tokens
            req.cached_tokens = 0
        self.kv.undo_admission(req)

    @staticmethod
    def reserve(req: Req) -> int:
        return int(min(req.remaining_new_tokens, RESERVE_TOKENS_CAP) * RESERVE_RATIO)

    # --- preemption and retraction -----------------------------------------------------------

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
        gain = sum(r.kv_len + self.reserve(r) for r in lower)
        return need <= self.kv.free_capacity() + gain

    def _preempt(self, victim: Req, by: Req) -> None:
        """Push a running request back to the queue for a higher-priority one.

        As with retraction, its output so far is kept and it is prefilled again (prompt + output)
        when it is admitted again; its stream continues where it stopped.
        """
        self.running.remove(victim)
        self.kv.release(victim)
        self.waiting.insert(0, victim)
        logger.info(
            "preempted %s (priority %d, %d tokens kept) for %s (priority %d)",
            victim.rid,
            victim.priority,
            len(victim.output_ids),
            by.rid,
            by.priority,
        )

    def _retract_until_fits(self, need: int) -> None:
        """Out of KV memory: push the newest, lowest-priority requests back to the queue.

        Their output so far is kept; they are prefilled again (prompt + output) when memory frees.
        """
        self.kv.ensure_free(need)
        while self.kv.available() < need and len(self.running) > 1:
            victim = min(self.running, key=lambda r: (r.priority, -r.queued_time))
            self.running.remove(victim)
            self.kv.release(victim)
            self.waiting.insert(0, victim)
            need -= 1
            self.kv.ensure_free(need)
            logger.info(
                "KV cache full: retracted %s (%d tokens kept)", victim.rid, len(victim.output_ids)
            )
