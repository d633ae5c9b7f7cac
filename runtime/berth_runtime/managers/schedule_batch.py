"""Req: one request's state inside the scheduler, from arrival to finish."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from berth_runtime.io_struct import FinishReason, TokenizedGenerateReqInput, TopLogprobs
from berth_runtime.mem_cache.radix_cache import TreeNode
from berth_runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from berth_runtime.constrained.grammar import Matcher
    from berth_runtime.managers.ngram_speculator import NgramIndex


class Req:
    """A request the scheduler owns: its tokens, its KV slots (via `req_row`) and its outputs."""

    __slots__ = (
        "rid",
        "origin_input_ids",
        "output_ids",
        "sampling_params",
        "max_new_tokens",
        "stream",
        "return_logprob",
        "top_logprobs_num",
        "return_prompt_logprobs",
        "priority",
        "generator",
        "req_row",
        "kv_len",
        "prefix_len",
        "exact_len",
        "last_node",
        "cached_tokens",
        "finished_reason",
        "sent_len",
        "output_token_logprobs",
        "output_top_logprobs",
        "input_token_logprobs",
        "input_top_logprobs",
        "prompt_logprobs_sent",
        "queued_time",
        "scheduled_time",
        "first_token_time",
        "max_stop_str_len",
        "grammar_future",
        "matcher",
        "ngrams",
        "lora_name",
        "lora_namespace",
    )

    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams,
        max_new_tokens: int,
        *,
        stream: bool = False,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        return_prompt_logprobs: bool = False,
        priority: int = 0,
    ) -> None:
        self.rid = rid
        self.origin_input_ids = input_ids
        self.output_ids: list[int] = []
        self.sampling_params = sampling_params
        self.max_new_tokens = max_new_tokens
        self.stream = stream
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        self.return_prompt_logprobs = return_prompt_logprobs
        self.priority = priority
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None and not sampling_params.is_greedy:
            self.generator = torch.Generator().manual_seed(sampling_params.seed)
        self.req_row: int | None = None  # row in ReqToTokenPool while it holds KV
        self.kv_len = 0  # tokens of fill_ids whose K/V are in the cache
        self.prefix_len = 0  # of those, tokens shared from the radix cache (locked there)
        # Of kv_len, the leading tokens whose K/V are what a prefill of them computes, bit for bit:
        # only these may go into the radix cache (see Scheduler._release).
        self.exact_len = 0
        self.last_node: TreeNode | None = None  # where the locked radix-cache prefix ends
        self.cached_tokens = 0  # prompt tokens reused from the prefix cache
        self.finished_reason: FinishReason | None = None
        self.sent_len = 0  # output ids already sent to the detokenizer
        self.output_token_logprobs: list[float] = []
        self.output_top_logprobs: list[TopLogprobs] = []
        self.input_token_logprobs: list[float | None] = []
        self.input_top_logprobs: list[TopLogprobs | None] = []
        self.prompt_logprobs_sent = False
        self.queued_time = time.time()
        self.scheduled_time = 0.0
        self.first_token_time = 0.0
        self.max_stop_str_len = max((len(s) for s in sampling_params.stop), default=0)
        # A constrained request: its grammar being compiled, then its place in the grammar (kept
        # across retraction and preemption, which keep the output it has accepted).
        self.grammar_future: Future[Any] | None = None
        self.matcher: Matcher | None = None
        # Speculative decoding (ngram): where each of its n-grams last occurred, built on demand.
        self.ngrams: NgramIndex | None = None
        # The LoRA adapter it runs under (None: the base model), and that adapter's part of the
        # prefix cache (0: the base's): K/V computed under one adapter is never reused by another.
        self.lora_name: str | None = None
        self.lora_namespace = 0

    @classmethod
    def from_tokenized(cls, msg: TokenizedGenerateReqInput, max_new_tokens: int) -> Req:
        """The one conversion point from the wire struct."""
        return cls(
            msg.rid,
            msg.input_ids,
            msg.sampling_params,
            max_new_tokens,
            stream=msg.stream,
            return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num,
            return_prompt_logprobs=msg.return_logprob and msg.logprob_start_len == 0,
            priority=msg.priority or 0,
        )

    @property
    def fill_len(self) -> int:
        """Tokens that must be in the KV cache before the next token can be sampled."""
        return len(self.origin_input_ids) + len(self.output_ids)

    def fill_ids(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.origin_input_ids)
        if end <= prompt_len:
            return self.origin_input_ids[start:end]
        return (self.origin_input_ids + self.output_ids)[start:end]

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def remaining_new_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    def __repr__(self) -> str:
        prompt, out = len(self.origin_input_ids), len(self.output_ids)
        return f"Req(rid={self.rid!r}, prompt={prompt}, out={out})"
