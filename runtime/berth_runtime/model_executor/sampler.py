"""Sampler: turn a batch of logits into next tokens (and their logprobs, or a prompt's), vectorized
over the batch: grammar masks, logit bias, penalties and min_tokens first, then greedy or seeded
sampling."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from berth_runtime.io_struct import TopLogprobs
from berth_runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from berth_runtime.constrained.grammar import Matcher


class SamplingRow(Protocol):
    """What sampling reads of a request (the scheduler's `Req`)."""

    sampling_params: SamplingParams
    generator: torch.Generator | None
    return_logprob: bool
    top_logprobs_num: int
    output_ids: list[int]
    origin_input_ids: list[int]
    matcher: Matcher | None


@dataclass
class SampleOutput:
    """One step's choice per row, with its logprob and top logprobs where asked for."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[TopLogprobs | None]


def sample_rows(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    eos_token_ids: set[int],
    greedy_ids: torch.Tensor | None = None,
) -> SampleOutput:
    """Next tokens for fp32 `logits` [B, V] of `rows` (modified in place where a row asks for a
    grammar, bias, penalties or min_tokens). Logprobs are those of the model, before any
    processing, except that a constrained row's are over what its grammar allows: the
    distribution its token was really drawn from. `greedy_ids`, each row's first maximum when
    the step computed it (a CUDA graph), are taken as they are when every row is plain greedy
    with no grammar."""
    none: list = [None] * len(rows)
    matchers = [r.matcher for r in rows]
    if greedy_ids is not None and all(plain_greedy(r) and r.matcher is None for r in rows):
        return SampleOutput(greedy_ids.tolist(), none, list(none))
    if any(m is not None for m in matchers):
        from berth_runtime.constrained.grammar import apply_grammars

        apply_grammars(logits, matchers)
    if all(plain_greedy(r) for r in rows):
        # max().indices, like argmax, takes the first maximum (and is faster).
        return SampleOutput(logits.max(dim=-1).indices.tolist(), none, list(none))
    raw_logprobs = None
    if any(r.return_logprob for r in rows):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    process_logits(logits, rows, eos_token_ids)
    infos = SamplingBatchInfo.build(
        [r.sampling_params for r in rows],
        [r.generator for r in rows],
        logits.shape[-1],
        logits.device,
    )
    token_ids = sample(logits, infos).tolist()
    logprobs, tops = list(none), list(none)
    if raw_logprobs is not None:
        for i, (row, token) in enumerate(zip(rows, token_ids)):
            if row.return_logprob:
                logprobs[i] = float(raw_logprobs[i, token])
                if row.top_logprobs_num:
                    tops[i] = top_logprobs(raw_logprobs[i], row.top_logprobs_num)
    return SampleOutput(token_ids, logprobs, tops)


def plain_greedy(row: SamplingRow) -> bool:
    """Greedy with nothing that reads or changes the logits (logprobs, bias, penalties,
    min_tokens) but a grammar's mask, which is applied before."""
    params = row.sampling_params
    return (
        params.is_greedy
        and not row.return_logprob
        and not params.logit_bias
        and not params.has_penalties
        and len(row.output_ids) >= params.min_new_tokens
    )


def process_logits(
    logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: set[int]
) -> None:
    """Logit bias, penalties and min_tokens, only for the rows that ask for them."""
    for i, row in enumerate(rows):
        params = row.sampling_params
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), device=logits.device)
            bias = torch.tensor(list(params.logit_bias.values()), device=logits.device)
            logits[i, ids] += bias
        if params.has_penalties:
            apply_penalties(logits, i, params, row.output_ids, row.origin_input_ids)
        # A grammar decides where its output ends: banning its stop token could leave nothing.
        if len(row.output_ids) < params.min_new_tokens and row.matcher is None:
            banned = set(params.stop_token_ids)
            if not params.ignore_eos:
                banned |= eos_token_ids
            if banned:
                logits[i, list(banned)] = float("-inf")


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: Sequence[int], top_k: int
) -> tuple[list[float], list[TopLogprobs]]:
    """Logprob of each of `next_token_ids` under the row of `logits` [N, V] that predicts it
    (row i predicts token i), and each such row's `top_k` most likely tokens (none if 0)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    token_logprobs = [float(logprobs[row, token]) for row, token in enumerate(next_token_ids)]
    tops = (
        [top_logprobs(logprobs[row], top_k) for row in range(len(next_token_ids))] if top_k else []
    )
    return token_logprobs, tops


def top_logprobs(logprobs: torch.Tensor, k: int) -> TopLogprobs:
    """The k most likely (logprob, token id) pairs of one row."""
    values, ids = torch.topk(logprobs, k)
    return list(zip(values.tolist(), ids.tolist()))


@dataclass
class SamplingBatchInfo:
    """Per-row sampling settings of one step, as tensors (built once per step by the scheduler)."""

    temperatures: torch.Tensor  # [B, 1]; greedy rows hold 1.0 and are taken by argmax
    top_ps: torch.Tensor  # [B]
    top_ks: torch.Tensor  # [B]; vocab size where disabled
    min_ps: torch.Tensor  # [B]
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    need_top_p_k: bool
    need_min_p: bool
    generators: list[torch.Generator | None]  # per-row generator of seeded requests

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingBatchInfo:
        greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_ks = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
        return cls(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device)[:, None],
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            need_top_p_k=any(
                not g and (p.top_p < 1.0 or 0 < p.top_k < vocab_size)
                for p, g in zip(params, greedy)
            ),
            need_min_p=any(not g and p.min_p > 0 for p, g in zip(params, greedy)),
            generators=generators,
        )


def sample(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Pick one token per row of `logits` [B, V] (already penalized/biased); returns [B] int64."""
    greedy_ids = torch.argmax(logits, dim=-1)
    if info.all_greedy:
        return greedy_ids
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    if info.need_top_p_k:
        probs = _top_k_top_p(probs, info.top_ks, info.top_ps)
    if info.need_min_p:
        threshold = probs.max(dim=-1, keepdim=True).values * info.min_ps[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    # Exponential race (Gumbel-max equivalent): argmax(p / E), E ~ Exp(1). Seeded rows draw E from
    # their own generator so their output does not depend on the rest of the batch.
    noise = torch.empty_like(probs).exponential_()
    for row, gen in enumerate(info.generators):
        if gen is not None:
            noise[row] = torch.empty(probs.shape[1], device=probs.device).exponential_(
                generator=gen
            )
    sampled = torch.argmax(probs / noise, dim=-1)
    return torch.where(info.greedy, greedy_ids, sampled)


def _top_k_top_p(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    cumulative = sorted_probs.cumsum(dim=-1)
    # Keep a token if it is within top-k and the mass before it is below top-p (the first always).
    drop = (ranks >= top_ks[:, None]) | ((cumulative - sorted_probs) >= top_ps[:, None])
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def apply_penalties(
    logits: torch.Tensor,
    row: int,
    params: SamplingParams,
    output_ids: list[int],
    prompt_ids: list[int],
) -> None:
    """OpenAI presence/frequency penalties (over output tokens) and the HF repetition penalty
    (over prompt and output tokens), in place on one row."""
    vocab = logits.shape[-1]
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids, device=logits.device), minlength=vocab).to(
            logits.dtype
        )
        logits[row] -= params.frequency_penalty * counts
        logits[row] -= params.presence_penalty * (counts > 0).to(logits.dtype)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), device=logits.device)
        values = logits[row, seen]
        penalized = torch.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
        logits[row, seen] = penalized
