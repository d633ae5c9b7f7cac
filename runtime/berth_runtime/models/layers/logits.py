"""Vocabulary scores with each row's leading candidates exact, whatever the lm_head's precision."""

from __future__ import annotations

import torch

# Scores per row that `exact_top_logits` recomputes: more than any top_logprobs (at most 20), and
# far more than the ties at a row's maximum.
EXACT_LOGIT_CANDIDATES = 32
# Rows recomputed at a time (prompt logprobs ask for every prompt position).
_EXACT_ROWS_PER_CHUNK = 256


def exact_top_logits(
    logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, cpu_kernels: bool
) -> torch.Tensor:
    """fp32 scores [rows, V] from a reduced-precision lm_head's `logits` (bf16, or the 8-bit
    copy's), with each row's top candidates recomputed exactly from the same `hidden` and `weight`.

    A bf16 lm_head accumulates in fp32 but rounds each score to bf16: steps of 0.125 at the size
    of a top score, so two leading tokens 0.08 apart (as in the embedded model's answer to
    "What is the capital of France?") come out tied, or in either order, depending on rounding
    noise elsewhere in the step. Rounding keeps order, so a row's true maximum is among its
    top bf16 scores; recomputing those with an fp32 result gives what an fp32 lm_head gives on
    these inputs: the greedy choice and the reported logprobs of the leading tokens lose the
    rounding, and the same inputs always give the same scores. The other scores keep their bf16
    value: they only enter the softmax sums. With `cpu_kernels`, Berth's CPU kernels find and
    recompute the candidates (torch.topk alone costs more than the lm_head at batch 32)."""
    out = logits.float()
    k = min(EXACT_LOGIT_CANDIDATES, out.shape[-1])
    for start in range(0, out.shape[0], _EXACT_ROWS_PER_CHUNK):
        rows = slice(start, start + _EXACT_ROWS_PER_CHUNK)
        if cpu_kernels:
            top = torch.ops.berth.top_k_indices(logits[rows], k)  # [r, k], unordered
            exact = torch.ops.berth.dot_rows(hidden[rows], weight, top)
        else:
            top = logits[rows].topk(k, dim=-1).indices
            candidates = weight[top].double()  # [r, k, hidden]
            exact = torch.bmm(candidates, hidden[rows].double().unsqueeze(-1)).squeeze(-1)
        out[rows].scatter_(1, top, exact.float())
    return out
