"""Fused mixture-of-experts for CUDA in Triton: every expert's projection of a step in one launch,
with no host sync, so MoE models decode in CUDA graphs.

`fused_experts(x, gate_up, down, experts, weights, activation)` computes what `SparseMoE`'s
grouped path computes: for each token, the sum over its top-k experts e of
weight * down[e] @ act(gate_up[e] @ x). The design is SGLang's and vLLM's `fused_moe`:

1. `align_by_expert` sorts the step's (token, k) pairs by expert, each expert's run padded to a
   multiple of BLOCK_M, so that every block of BLOCK_M sorted pairs belongs to one expert. All on
   the device, in shapes fixed by the token count (the padding's worst case): nothing is read
   back to the host, and a CUDA graph can replay it.
2. `_expert_matmul_kernel` (program: one block of pairs x BLOCK_N output columns) multiplies the
   block's rows of its input by its expert's weight [N, K], accumulating in fp32 (IEEE products
   in fp32, not TF32), optionally times each pair's routing weight, and writes each pair's row.
   Run twice: gate/up on the tokens' hidden states, then down on the activated pairs.
3. The k weighted rows of each token are summed.

CPU tensors run only under Triton's interpreter (TRITON_INTERPRET=1 set before Triton is
imported), which is how CI tests the kernel without a GPU; CPU serving uses the grouped path.
"""

from __future__ import annotations

from typing import Any

import torch

from berth_runtime.kernels.triton_attention import interpreting, library_interpreted, tl, triton
from berth_runtime.models.layers.mlp import Activation, gated

# Pairs per block. 16 is the smallest tile tensor cores take; decode steps have few pairs per
# expert, so larger blocks would mostly multiply padding.
BLOCK_M = 16


def _expert_matmul_kernel(
    A,
    W,
    Out,
    PairWeights,
    SortedPairs,
    BlockExperts,
    NumPadded,
    n_out,
    k_in,
    num_pairs,
    stride_a_row,
    stride_w_expert,
    stride_w_out,
    stride_out_row,
    TOP_K: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program (block, column tile): Out[pair, cols] = A[pair // TOP_K] . W[expert, cols]^T for
    the block's pairs (times the pair's weight if WEIGHTED)."""
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(NumPadded):
        return  # past the last expert's padded run
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(SortedPairs + rows)
    valid = pairs < num_pairs  # padding holds num_pairs
    expert = tl.load(BlockExperts + block).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    a_ptrs = A + (pairs // TOP_K).to(tl.int64)[:, None] * stride_a_row + depth[None, :]
    w_ptrs = W + expert * stride_w_expert + cols[None, :].to(tl.int64) * stride_w_out
    w_ptrs = w_ptrs + depth[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(k_in, BLOCK_K)):
        inside = depth < k_in - step * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & inside[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=inside[:, None] & (cols[None, :] < n_out), other=0.0)
        if UPCAST:  # the interpreter has no bf16 matmul: fp32 products of bf16 values are exact
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision="ieee")
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if WEIGHTED:
        acc = acc * tl.load(PairWeights + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    if UPCAST:  # the interpreter truncates fp32 -> bf16: round to nearest even first
        bits = acc.to(tl.uint32, bitcast=True)
        acc = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    out_ptrs = Out + pairs.to(tl.int64)[:, None] * stride_out_row + cols[None, :]
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < n_out))


_kernels: dict[bool, Any] = {}


def kernel(interpret: bool | None = None) -> Any:
    """The jitted kernel for the interpreter or the GPU (see `triton_attention.kernel`)."""
    if triton is None:
        raise RuntimeError("Triton is not installed: the fused MoE kernel is unavailable")
    mode = interpreting() if interpret is None else interpret
    if mode not in _kernels:
        if mode and not library_interpreted():
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after Triton was imported; set it before importing"
            )
        # The pair count and the padded capacity change with the batch: one binary for all.
        _kernels[mode] = triton.jit(_expert_matmul_kernel, do_not_specialize=("num_pairs",))
    return _kernels[mode]


def align_by_expert(
    experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs (indices into experts.view(-1)) sorted by expert, each expert's run padded to a
    multiple of `block_m` with the pair count; each block's expert; and the padded length (a
    one-element tensor). Shapes depend on the pair count only: no host sync."""
    flat = experts.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    # scatter_add_ rather than bincount: bincount reads the largest id back to size its output.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)
    by_expert = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[by_expert]
    capacity = num_pairs + num_experts * (block_m - 1)
    capacity = (capacity + block_m - 1) // block_m * block_m
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs[(padded_end - padded)[by_expert] + rank] = order
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    return sorted_pairs, block_experts.clamp_(max=num_experts - 1), padded_end[-1:]


def expert_matmul(
    a: torch.Tensor,
    weight: torch.Tensor,
    alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    top_k: int,
    pair_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """[pairs, N]: each pair's row of `a` (row pair // top_k) times its expert's [N, K] weight."""
    interpret = interpreting()
    grid, args, kwargs = launch_arguments(a, weight, alignment, top_k, pair_weights, interpret)
    out = args[2]
    kernel(interpret)[grid](*args, **kwargs)
    return out


def launch_arguments(
    a: torch.Tensor,
    weight: torch.Tensor,
    alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    top_k: int,
    pair_weights: torch.Tensor | None,
    interpret: bool,
) -> tuple[tuple[int, int], tuple[Any, ...], dict[str, Any]]:
    """The kernel's grid, arguments and keyword arguments."""
    sorted_pairs, block_experts, num_padded = alignment
    num_pairs = a.shape[0] * top_k
    _, n_out, k_in = weight.shape
    if a.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("expert_matmul needs unit stride on the inner dimension")
    out = torch.empty(num_pairs, n_out, dtype=a.dtype, device=a.device)
    block_n = 64 if n_out >= 64 else 32
    block_k = 32 if a.dtype == torch.float32 else 64
    weighted = pair_weights is not None
    args = (
        a,
        weight,
        out,
        pair_weights if weighted else out,  # not read unless WEIGHTED
        sorted_pairs,
        block_experts,
        num_padded,
        n_out,
        k_in,
        num_pairs,
        a.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
    )
    kwargs = {
        "TOP_K": top_k,
        "WEIGHTED": weighted,
        "BLOCK_M": BLOCK_M,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "UPCAST": interpret and a.dtype == torch.bfloat16,
        "num_warps": 4,
        "num_stages": 2,
    }
    grid = (block_experts.shape[0], triton.cdiv(n_out, block_n))
    return grid, args, kwargs


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    activation: Activation,
) -> torch.Tensor:
    """The MoE layer's output [T, H] for x [T, H], stacked weights gate_up [E, 2I, H] and down
    [E, H, I], and each token's experts and routing weights [T, k]."""
    tokens, top_k = experts.shape
    alignment = align_by_expert(experts, gate_up.shape[0])
    projected = expert_matmul(x.contiguous(), gate_up, alignment, top_k)
    gate, up = projected.chunk(2, dim=-1)
    activated = gated(gate, up, activation).contiguous()
    pair_weights = weights.reshape(-1).contiguous()
    out = expert_matmul(activated, down, alignment, 1, pair_weights)
    return out.view(tokens, top_k, -1).sum(dim=1)
