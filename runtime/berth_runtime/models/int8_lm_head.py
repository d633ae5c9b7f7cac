"""An 8-bit copy of the lm_head that ranks a small CPU step's vocabulary at half bf16's bytes.

At one to a few rows the lm_head is a pass over a [V, hidden] weight: on the embedded model
49,152 x 576, 56 MB in bf16, a fifth of a single-stream decode step. Here it is stored as
symmetric int8 blocks of 32 (scale amax / 127 in fp16) and run by `torch.ops.berth.quant_linear`
on int8 activations. Those scores only pick each row's candidates: `exact_top_logits` recomputes
the leading ones from the bf16 weight in fp32, as it does after oneDNN's bf16 lm_head, so the
greedy token and the reported logprobs of the leading tokens are what they were; the other scores
(which enter softmax sums and sampling) carry int8's error instead of bf16's rounding, about the
same size (checked in tests/integration/runtime/test_quant_linear.py).
"""

from __future__ import annotations

import torch

BLOCK = 32
LANES = 16


def quantize_rows_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (N % 16 == 0, K % 32 == 0) -> `quant_linear`'s 8-bit layout: codes uint8
    [N/16, K/32, 8, 16, 4] holding q + 128 (q = round(w / d) in -127..127, vector j holding
    k = 4j..4j+3 of each lane) and fp16 pairs [N/16, K/32, 2, 16] of d and m = -128 d."""
    n, k = weight.shape
    if n % LANES or k % BLOCK:
        raise ValueError(f"quant_linear needs N % 16 == 0 and K % 32 == 0, got [{n}, {k}]")
    blocks = weight.float().view(n, k // BLOCK, BLOCK)
    scale = (blocks.abs().amax(-1) / 127).half().float()  # [N, K/32], as stored
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round(blocks * inverse[..., None]).clamp(-127, 127).to(torch.int16) + 128
    codes = q.to(torch.uint8).view(n // LANES, LANES, k // BLOCK, 8, 4)
    codes = codes.permute(0, 2, 3, 1, 4).contiguous()  # [group, block, vector, lane, byte]
    pairs = torch.stack((scale, -128 * scale), dim=-1).view(n // LANES, LANES, k // BLOCK, 2)
    return codes, pairs.permute(0, 2, 3, 1).contiguous().half()


def dequantize_q8(codes: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] an 8-bit layout stands for (tests)."""
    groups, blocks = codes.shape[:2]
    q = codes.permute(0, 3, 1, 2, 4).reshape(groups * LANES, blocks, BLOCK).float()
    d, m = pairs.float().permute(0, 3, 1, 2).reshape(groups * LANES, blocks, 2).unbind(-1)
    return (q * d[..., None] + m[..., None]).reshape(groups * LANES, blocks * BLOCK)


class Int8LmHead:
    """The lm_head's 8-bit copy, used for steps of at most `max_rows` rows. A vocabulary that is
    not a multiple of 16 is padded with zero rows, whose scores are cut off."""

    def __init__(self, weight: torch.Tensor, max_rows: int) -> None:
        self.max_rows = max_rows
        self.vocab_size = weight.shape[0]
        padding = -self.vocab_size % LANES
        if padding:
            weight = torch.cat([weight, weight.new_zeros(padding, weight.shape[1])])
        self.codes, self.pairs = quantize_rows_q8(weight)

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        return weight.dim() == 2 and weight.shape[1] % BLOCK == 0

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, V] in hidden's dtype: approximate scores, to be refined by exact_top_logits."""
        out = torch.ops.berth.quant_linear(hidden, self.codes, self.pairs)
        return out if out.shape[1] == self.vocab_size else out[:, : self.vocab_size]

    def nbytes(self) -> int:
        return self.codes.nbytes + self.pairs.nbytes
