"""Scheduler: one process's engine loop body: take requests in, and run steps of schedule ->
execute -> update over a SchedulePolicy, a ModelRunner and an OutputProcessor."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from berth_runtime.constrained.grammar import GrammarCompiler, GrammarError, Matcher
from berth_runtime.io_struct import (
    AbortReq,
    BatchOutput,
    FinishReason,
    FlushCacheOut,
    FlushCacheReq,
    LoadLoraAdapterReq,
    LoraAdapterOut,
    SchedulerStats,
    TokenizedGenerateReqInput,
    UnloadLoraAdapterReq,
)
from berth_runtime.lora.adapter import LoraError
from berth_runtime.managers.ngram_speculator import NgramIndex
from berth_runtime.managers.output_processor import OutputProcessor
from berth_runtime.managers.schedule_batch import Req
from berth_runtime.managers.schedule_policy import BatchPlan, DecodeBatch, SchedulePolicy
from berth_runtime.mem_cache.kv_manager import KVManager
from berth_runtime.model_executor.forward_batch import DecodeLogits, ForwardBatch
from berth_runtime.model_executor.host_inputs import upload
from berth_runtime.model_executor.sampler import (
    SampleOutput,
    plain_greedy,
    prompt_logprobs,
    sample_rows,
)
from berth_runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Speculative drafts come from the latest earlier occurrence of the last NGRAM_MAX..NGRAM_MIN
# tokens (prompt lookup's usual range: one token alone matches too often to be worth verifying).
NGRAM_MIN, NGRAM_MAX = 2, 4


@dataclass
class StepResult:
    """What a step's model run produced: the requests that sampled a token, and their tokens
    (or, for a speculative verification step, each request's run of verified tokens)."""

    sampled_reqs: list[Req]
    sampled: SampleOutput | None
    verified: list[list[int]] | None = None


@dataclass
class LaunchedDecode:
    """A decode step running on the device whose tokens the host has not read yet (the overlap
    scheduler): its requests, their new tokens on the device (the next step's inputs), and a
    host copy of them on its way."""

    reqs: list[Req]
    token_ids: torch.Tensor
    host_ids: torch.Tensor
    copied: torch.cuda.Event | None

    def tokens(self) -> list[int]:
        """The step's tokens, once the device has computed and copied them."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host_ids.tolist()


class Scheduler:
    """Continuous batching over a ModelRunner; owns every `Req` from arrival to finish.

    `step()` is one unit of work: the policy picks a prefill (extend) or a decode batch, the model
    runs it and the sampler picks tokens, then the outputs are updated and packed. Requests join
    between steps and leave as soon as they finish.

    With CUDA graphs, decode overlaps (SGLang's overlap scheduler): while the requests are plain
    greedy and nothing waits, a step launches the next decode from the current one's tokens on
    the device, then reads the current one back and takes its tokens, so the host's work on one
    step's tokens runs while the GPU computes the next. A request that finishes on a step has
    had its next token computed already: that token is dropped with its KV slot.
    """

    def __init__(
        self,
        args: ServerArgs,
        runner,
        *,
        eos_token_ids: set[int],
        decode: Callable[[list[int]], str],
        grammar: GrammarCompiler | None = None,
    ) -> None:
        self.args = args
        self.runner = runner
        self.device = runner.device
        self.context_len = runner.context_len
        self.kv = KVManager(
            runner.kv_pool, runner.req_to_token_pool, prefix_cache=not args.disable_radix_cache
        )
        self.max_total_tokens = self.kv.capacity
        self.eos_token_ids = eos_token_ids
        self.max_running = min(args.max_running_requests, runner.req_to_token_pool.max_reqs)
        self.policy = SchedulePolicy(args, self.kv, self.max_running)
        self.outputs = OutputProcessor(eos_token_ids, decode, self.context_len)
        self.finished_unsent: list[Req] = []  # finished outside a step (aborted, rejected)
        self.grammar = grammar
        # Constrained requests whose grammar is compiling; they join the queue once it is ready.
        self.grammar_queue: list[Req] = []
        self.speculate = args.speculative_algorithm == "ngram"
        self.num_draft_tokens = args.speculative_num_draft_tokens
        self.speculative_max_batch = args.speculative_max_batch
        self.overlap = not (args.disable_overlap_schedule or self.speculate)
        self.launched: LaunchedDecode | None = None  # a decode step not read back yet
        # LoRA adapters (None: off): which may run together, and the unloads waiting for their
        # requests to finish (adapter -> the req_ids to answer).
        self.lora = getattr(runner, "lora", None)
        if self.lora is not None:
            self.policy.adapter_may_join = self.lora.may_join
        self.pending_unloads: dict[str, list[str]] = {}
        self.control_replies: list[LoraAdapterOut] = []

    # --- inputs ------------------------------------------------------------------------------

    def handle_generate(self, msg: TokenizedGenerateReqInput) -> None:
        prompt_len = len(msg.input_ids)
        room = min(self.context_len, self.max_total_tokens) - prompt_len
        max_new = msg.sampling_params.max_new_tokens
        max_new = room if max_new is None else min(max_new, room)
        req = Req.from_tokenized(msg, max_new)
        if msg.lora_name is not None and not self._take_adapter(req, msg.lora_name):
            return
        if room <= 0 or prompt_len == 0:
            self._finish_abort(req, f"prompt of {prompt_len} tokens does not fit", 400)
            return
        if max_new == 0 and not req.return_prompt_logprobs:
            req.finished_reason = FinishReason("length")
            self.finished_unsent.append(req)
            return
        limit = self.args.max_queued_requests
        if limit is not None and self.policy.num_queued() + len(self.grammar_queue) >= limit:
            self._finish_abort(req, f"too many queued requests ({limit}); retry later", 503)
            return
        spec = msg.sampling_params.grammar
        if spec is not None:
            if self.grammar is None:
                self._finish_abort(req, "constrained decoding is off (--grammar-backend none)", 400)
                return
            req.grammar_future = self.grammar.submit(spec)
            self.grammar_queue.append(req)
            return
        self.policy.waiting.append(req)

    def _take_adapter(self, req: Req, name: str) -> bool:
        """Run `req` under adapter `name`; False (refused) if this server does not serve it."""
        if self.lora is None:
            message = "LoRA adapters are off on this server (start it with --enable-lora)"
            self._finish_abort(req, message, 400, param="model")
            return False
        if not self.lora.serves(name):
            self._finish_abort(req, f"no LoRA adapter named {name!r} is loaded", 404, "model")
            return False
        req.lora_name = name
        req.lora_namespace = self.lora.namespace(name)
        return True

    # --- LoRA adapters at run time -------------------------------------------------------------

    def handle_load_lora(self, msg: LoadLoraAdapterReq) -> None:
        if self.lora is None:
            self._reply(msg.req_id, "LoRA adapters are off (start with --enable-lora)", 400)
            return
        try:
            self.lora.load(msg.name, msg.path)
        except LoraError as e:
            self._reply(msg.req_id, str(e), e.status)
            return
        except Exception as e:  # an unreadable file, a read error: the load fails, not the rank
            logger.exception("Loading LoRA adapter %r failed", msg.name)
            self._reply(msg.req_id, f"loading {msg.name!r} failed: {type(e).__name__}: {e}", 500)
            return
        self._reply(msg.req_id, "", 200)

    def handle_unload_lora(self, msg: UnloadLoraAdapterReq) -> None:
        """Answered once the adapter's requests are done (`finish_unloads`)."""
        if self.lora is None:
            self._reply(msg.req_id, "LoRA adapters are off (start with --enable-lora)", 400)
            return
        if msg.name not in self.pending_unloads:
            try:
                self.lora.start_unload(msg.name)
            except LoraError as e:
                self._reply(msg.req_id, str(e), e.status)
                return
        self.pending_unloads.setdefault(msg.name, []).append(msg.req_id)
        self.finish_unloads()

    def finish_unloads(self) -> None:
        """Drop the adapters being unloaded whose requests are all done, with their cached K/V."""
        if not self.pending_unloads or self.lora is None:
            return
        reqs = self.policy.live_reqs() + self.grammar_queue
        if self.launched is not None:
            reqs += self.launched.reqs
        in_use = {r.lora_name for r in reqs if r.lora_name is not None and not r.finished}
        for name, namespace in self.lora.finish_unloads(in_use):
            self.kv.drop_namespace(namespace)
            for req_id in self.pending_unloads.pop(name, []):
                self._reply(req_id, "", 200)

    def _reply(self, req_id: str, message: str, status: int) -> None:
        self.control_replies.append(
            LoraAdapterOut(req_id, success=status == 200, message=message, status_code=status)
        )

    def take_control_replies(self) -> list[LoraAdapterOut]:
        replies, self.control_replies = self.control_replies, []
        return replies

    def _use_adapters(self, reqs: list[Req], rows: list[int]) -> None:
        """Tell the model which rows of the next step run under which adapter."""
        if self.lora is not None:
            live = self.policy.live_adapters()
            self.lora.prepare([r.lora_name for r in reqs], rows, live)

    def _admit_compiled(self) -> None:
        """Queue the constrained requests whose grammar has compiled (refuse those that failed)."""
        compiling = []
        for req in self.grammar_queue:
            future = req.grammar_future
            assert future is not None
            if not future.done():
                compiling.append(req)
                continue
            req.grammar_future = None
            try:
                req.matcher = Matcher(future.result())
            except GrammarError as e:
                # The only check of a grammar: the API process does not load xgrammar (nor torch).
                kind = req.sampling_params.grammar.kind  # type: ignore[union-attr]
                message = f"invalid {kind.replace('_', ' ')}: {e}"
                self._finish_abort(req, message, 400, param=f"sampling_params.{kind}")
            except Exception as e:  # the vocabulary could not be read (on the first grammar)
                logger.exception("Grammar backend failed")
                self._finish_abort(
                    req, f"constrained decoding failed: {type(e).__name__}: {e}", 500
                )
            else:
                self.policy.waiting.append(req)
        self.grammar_queue = compiling

    def handle_abort(self, msg: AbortReq) -> None:
        for req in self.policy.live_reqs():
            if msg.abort_all or req.rid == msg.rid:
                self._finish_abort(req, msg.message, msg.status_code)
        for req in list(self.grammar_queue):
            if msg.abort_all or req.rid == msg.rid:
                self.grammar_queue.remove(req)
                if req.grammar_future is not None:
                    req.grammar_future.cancel()
                self._finish_abort(req, msg.message, msg.status_code)

    def handle_flush_cache(self, _: FlushCacheReq) -> FlushCacheOut:
        if self.policy.is_busy() or self.launched is not None:
            return FlushCacheOut(success=False, message="the scheduler is busy; retry when idle")
        self.kv.flush()
        return FlushCacheOut(success=True)

    def _finish_abort(
        self, req: Req, message: str, status_code: int, param: str | None = None
    ) -> None:
        req.finished_reason = FinishReason(
            "abort", message=message, status_code=status_code, param=param
        )
        self.kv.release(req)
        self.policy.remove(req)
        self.finished_unsent.append(req)

    # --- the step ----------------------------------------------------------------------------

    @property
    def is_idle(self) -> bool:
        busy = self.policy.is_busy() or self.launched is not None
        return not (busy or self.finished_unsent or self.grammar_queue)

    @property
    def only_compiling(self) -> bool:
        """Nothing to run but grammars still compiling: worth a short wait, not a spin."""
        return bool(self.grammar_queue) and not (self.policy.is_busy() or self.finished_unsent)

    def step(self) -> BatchOutput | None:
        """Run one batch; return what advanced (None when there was nothing to do)."""
        if self.grammar_queue:
            self._admit_compiled()
        if self.launched is not None:
            return self._step_overlapped()
        batch = self.policy.next_batch()
        if isinstance(batch, DecodeBatch) and self._can_overlap(batch.reqs):
            self.launched = self._launch_decode(batch.reqs, [r.output_ids[-1] for r in batch.reqs])
            return self._update(None, None)
        result = self._execute(batch) if batch is not None else None
        return self._update(batch, result)

    # --- overlapped decode (CUDA graphs) -------------------------------------------------------

    def _can_overlap(self, reqs: list[Req]) -> bool:
        """Whether the next decode step of `reqs` may be launched before the current one's
        tokens are read back: a graph runs it (its argmax is each request's token, on the
        device), every request is plain greedy with room left in its context, nothing waits to
        be scheduled (a prefill needs the host's view of every request), and the pool has a
        free slot for each request without evicting or retracting."""
        graphs = getattr(self.runner, "graph_runner", None)
        return (
            self.overlap
            and graphs is not None
            and len(reqs) <= graphs.max_bs
            and not (self.policy.waiting or self.policy.chunked_req or self.grammar_queue)
            and self.kv.available() >= len(reqs)
            and all(
                plain_greedy(r) and r.matcher is None and r.kv_len < self.context_len for r in reqs
            )
        )

    def _launch_decode(
        self, reqs: list[Req], input_ids: list[int] | torch.Tensor
    ) -> LaunchedDecode:
        """Launch a decode step and start copying its tokens to the host, without waiting."""
        decoded = self._decode(reqs, input_ids)
        assert decoded.greedy_ids is not None, "a graph ran the step"
        token_ids = decoded.greedy_ids.clone()  # the graph's own buffer is the next replay's
        if not token_ids.is_cuda:
            return LaunchedDecode(reqs, token_ids, token_ids, None)
        host_ids = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
        host_ids.copy_(token_ids, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return LaunchedDecode(reqs, token_ids, host_ids, copied)

    def _step_overlapped(self) -> BatchOutput | None:
        """With a decode step in flight: launch the next one from its tokens on the device if
        it may be, then read the one in flight back and take its tokens (requests aborted
        meanwhile are skipped: their output has gone already)."""
        launched, self.launched = self.launched, None
        assert launched is not None
        alive = [i for i, r in enumerate(launched.reqs) if not r.finished]
        reqs = [launched.reqs[i] for i in alive]
        if reqs and self._can_overlap(reqs):
            token_ids = launched.token_ids
            if len(alive) < len(launched.reqs):
                token_ids = token_ids[upload(token_ids.device, np.array(alive, dtype=np.int64))[0]]
            self.launched = self._launch_decode(reqs, token_ids)
        tokens = launched.tokens()
        none: list = [None] * len(reqs)
        sampled = SampleOutput([tokens[i] for i in alive], none, list(none))
        return self._update(DecodeBatch(reqs), StepResult(reqs, sampled))

    def _decode(self, reqs: list[Req], input_ids: list[int] | torch.Tensor) -> DecodeLogits:
        """Run one decode step of `reqs` (each one's next input token, from the host or still on
        the device) and advance their KV lengths."""
        slots = self.kv.alloc_decode(reqs)
        self._use_adapters(reqs, [1] * len(reqs))
        decoded = self.runner.forward_decode(
            input_ids, [r.kv_len for r in reqs], slots, [r.req_row for r in reqs]
        )
        # K/V of an input still on the device may go with its request (aborted) before its token
        # is known on the host: it is never shared with the cache.
        exact = isinstance(input_ids, list) and self.runner.decode_matches_prefill(len(reqs))
        for r in reqs:
            if exact and r.exact_len == r.kv_len:
                r.exact_len += 1
            r.kv_len += 1
        return decoded

    def _execute(self, batch: BatchPlan) -> StepResult:
        """Run the model over the batch and sample the next token of every request that
        completes its prompt or decodes (prompt logprobs are recorded on the way)."""
        if isinstance(batch, DecodeBatch):
            reqs = batch.reqs
            drafts = self._drafts(reqs)
            if drafts is not None:
                return self._execute_verify(reqs, drafts)
            decoded = self._decode(reqs, [r.output_ids[-1] for r in reqs])
            sampled = sample_rows(decoded.logits, reqs, self.eos_token_ids, decoded.greedy_ids)
            return StepResult(reqs, sampled)

        entries = batch.entries
        slots = self.kv.alloc_extend([(e.req, e.start, e.end) for e in entries])
        input_ids: list[int] = []
        for e in entries:
            input_ids += e.req.fill_ids(e.start, e.end)
        forward = ForwardBatch.extend(
            input_ids,
            [e.start for e in entries],
            [e.end - e.start for e in entries],
            slots,
            [e.req.req_row for e in entries],
            self.kv.req_to_token.req_to_token,
            self.device,
            with_mask=self.runner.needs_attn_mask,
        )
        self._use_adapters([e.req for e in entries], [e.end - e.start for e in entries])
        hidden = self.runner.forward(forward)
        row_start = 0
        for e in entries:
            e.req.kv_len = e.req.exact_len = e.end
            if e.req.return_prompt_logprobs:
                rows = hidden[row_start : row_start + (e.end - e.start)]
                self._add_prompt_logprobs(e.req, e.start, e.end, rows)
            row_start += e.end - e.start
        # Prompt scoring only (echo + logprobs, max_tokens=0) ends without sampling.
        done = [i for i, e in enumerate(entries) if e.completes and e.req.max_new_tokens > 0]
        reqs = [entries[i].req for i in done]
        for req in reqs:
            self.kv.cache_prefilled(req)
        if not reqs:
            return StepResult([], None)
        return StepResult(reqs, self._sample(reqs, hidden[forward.last_token_index[done]]))

    # --- speculative decoding (ngram) ----------------------------------------------------------

    def _drafts(self, reqs: list[Req]) -> list[list[int]] | None:
        """Each request's draft for this decode step, or None to decode plainly: speculation is
        off, the batch is too large, a request needs more than greedy's argmax (logprobs,
        penalties, bias, min_tokens, a grammar), no request has a draft, or the KV pool has no
        room for the drafts."""
        if not self.speculate or len(reqs) > self.speculative_max_batch:
            return None
        if not all(plain_greedy(r) and r.matcher is None for r in reqs):
            return None
        drafts = []
        for r in reqs:
            # The draft's tokens plus the one decoding adds must fit the request's budget.
            room = min(r.remaining_new_tokens, self.context_len - r.fill_len) - 1
            limit = min(self.num_draft_tokens, room)
            if limit <= 0:
                drafts.append([])
                continue
            if r.ngrams is None:
                r.ngrams = NgramIndex(NGRAM_MIN, NGRAM_MAX)
            drafts.append(r.ngrams.propose(r.origin_input_ids, r.output_ids, limit))
        need = sum(1 + len(d) for d in drafts)
        if not any(drafts) or self.kv.free_capacity() < need:
            return None
        return drafts

    def _execute_verify(self, reqs: list[Req], drafts: list[list[int]]) -> StepResult:
        """Run each request's last token and its draft through one step on decode's weights (a
        decode step of one row per token where that picks the same weights, else an extend);
        keep the draft's longest prefix that greedy decoding picks itself, then the token it
        picks after that. Every token kept is bit for bit what plain decoding computes (each row
        runs alone: 4-bit or oneDNN projections, per-token attention), so the output is too."""
        spans = [(r, r.kv_len, r.kv_len + 1 + len(d)) for r, d in zip(reqs, drafts)]
        slots = self.kv.alloc_extend(spans)
        tokens = [tok for r, d in zip(reqs, drafts) for tok in (r.output_ids[-1], *d)]
        if self.runner.verify_as_decode(len(reqs), len(tokens)):
            # Row j of a request's run is a decode step of the request at position kv_len + j:
            # its attention reads the slots up to itself, the drafts before it included (their
            # K/V are written before attention in every layer), through the decode path (in one
            # C++ call on the 4-bit weights).
            rows = [(r, j) for r, d in zip(reqs, drafts) for j in range(1 + len(d))]
            self._use_adapters([r for r, _ in rows], [1] * len(rows))
            logits = self.runner.forward_decode(
                tokens, [r.kv_len + j for r, j in rows], slots, [r.req_row for r, _ in rows]
            ).logits
        else:
            forward = ForwardBatch.extend(
                tokens,
                [r.kv_len for r in reqs],
                [1 + len(d) for d in drafts],
                slots,
                [r.req_row for r in reqs],
                self.kv.req_to_token.req_to_token,
                self.device,
                verify=True,
                with_mask=self.runner.needs_attn_mask,
            )
            self._use_adapters(reqs, [1 + len(d) for d in drafts])
            logits = self.runner.compute_logits(self.runner.forward(forward))
        picked = logits.max(dim=-1)
        greedy = picked.indices.tolist()
        verified, row = [], 0
        for draft in drafts:
            choices = greedy[row : row + 1 + len(draft)]
            accepted = 0
            while accepted < len(draft) and draft[accepted] == choices[accepted]:
                accepted += 1
            verified.append([*draft[:accepted], choices[accepted]])
            row += 1 + len(draft)
        # The rejected draft tokens' slots go back now: positions past the last token kept.
        table = self.kv.req_to_token.req_to_token
        for r, draft, tokens in zip(reqs, drafts, verified):
            kept_end = r.kv_len + len(tokens)
            self.kv.kv_pool.free(table[r.req_row, kept_end : r.kv_len + 1 + len(draft)].clone())
        stats = self.outputs.stats
        stats.spec_draft_tokens += sum(len(d) for d in drafts)
        stats.spec_accepted_tokens += sum(len(v) - 1 for v in verified)
        return StepResult(reqs, None, verified)

    def _take_verified(self, reqs: list[Req], verified: list[list[int]]) -> None:
        """Append each request's verified tokens (up to where it finishes); its KV keeps the
        inputs that produced them and frees the draft's rejected rest."""
        exact = self.runner.decode_matches_prefill(len(reqs))
        table = self.kv.req_to_token.req_to_token
        for req, tokens in zip(reqs, verified):
            start = req.kv_len
            taken = self.outputs.take_accepted(req, tokens)
            # Slots left: [start, start + len(tokens)); the first `taken` hold K/V of the
            # sequence's own tokens (its last one before this step, then accepted draft tokens),
            # the rest those of tokens after the one it finished on.
            self.kv.kv_pool.free(table[req.req_row, start + taken : start + len(tokens)].clone())
            if exact and req.exact_len == start:
                req.exact_len += taken
            req.kv_len += taken

    def _sample(self, reqs: list[Req], hidden: torch.Tensor) -> SampleOutput:
        logits = self.runner.compute_logits(hidden)
        return sample_rows(logits, reqs, self.eos_token_ids)

    def _update(self, batch: BatchPlan | None, result: StepResult | None) -> BatchOutput | None:
        """Take the sampled tokens in, finish and release who is done, settle the queues, and
        pack what advanced (including requests finished outside a step)."""
        advanced, self.finished_unsent = self.finished_unsent, []
        if batch is not None and result is not None:
            stats = self.outputs.stats
            if isinstance(batch, DecodeBatch):
                advanced += batch.reqs
            else:
                for e in batch.entries:
                    if e.completes and e.req.max_new_tokens == 0:
                        e.req.finished_reason = FinishReason("length")
                        self.kv.release(e.req)
                        advanced.append(e.req)
                stats.prompt_tokens += sum(
                    len(r.origin_input_ids) for r in result.sampled_reqs if not r.output_ids
                )
                advanced += result.sampled_reqs
            if result.verified is not None:
                self._take_verified(result.sampled_reqs, result.verified)
                for req in result.sampled_reqs:
                    if req.finished:
                        self.kv.release(req)
            if result.sampled is not None:
                self.outputs.take_sampled(result.sampled_reqs, result.sampled)
                for req in result.sampled_reqs:
                    if req.finished:
                        self.kv.release(req)
            self.policy.settle(batch)
        if not advanced:
            return None
        self.outputs.stats.step_count += 1
        return self.outputs.make_output(advanced)

    def _add_prompt_logprobs(self, req: Req, start: int, end: int, hidden: torch.Tensor) -> None:
        """Logprob of each prompt token given the ones before it (the first has none)."""
        prompt = req.origin_input_ids
        if start == 0:
            req.input_token_logprobs.append(None)
            req.input_top_logprobs.append(None)
        # Position i predicts token i + 1; the prompt's last position predicts no prompt token.
        next_token_ids = prompt[start + 1 : end + 1]
        token_logprobs, tops = prompt_logprobs(
            self.runner.compute_logits(hidden), next_token_ids, req.top_logprobs_num
        )
        req.input_token_logprobs.extend(token_logprobs)
        req.input_top_logprobs.extend(tops)

    # --- statistics --------------------------------------------------------------------------

    def get_stats(self) -> SchedulerStats:
        stats = self.outputs.stats
        evictable = self.kv.evictable_size()
        # As in SGLang, cached KV that no request holds is not "used": it can be evicted.
        used = self.max_total_tokens - self.kv.available() - evictable
        return SchedulerStats(
            time=time.time(),
            num_running_reqs=self.policy.num_live,
            num_waiting_reqs=len(self.policy.waiting) + len(self.grammar_queue),
            num_used_tokens=used,
            num_cached_tokens=self.kv.cached_size(),
            max_total_num_tokens=self.max_total_tokens,
            gen_throughput=stats.throughput(idle=self.is_idle),
            cache_hit_rate=(
                self.policy.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
            ),
            step_count=stats.step_count,
            generated_tokens=stats.generated_tokens,
            spec_draft_tokens=stats.spec_draft_tokens,
            spec_accepted_tokens=stats.spec_accepted_tokens,
            lora_running=self.lora.pool.resident() if self.lora is not None else [],
            lora_waiting=sorted({r.lora_name for r in self.policy.waiting if r.lora_name}),
        )
