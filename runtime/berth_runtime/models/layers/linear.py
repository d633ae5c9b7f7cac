"""Projections on CPU and GPU: oneDNN with prepacked weights, the GGUF's 4-bit weights for small
decode steps, and a single row through a matrix-vector product."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from berth_runtime.models.gguf_q4 import Int4Weight
from berth_runtime.utils import cpu_isa


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except that a single bf16/fp16 row goes through a matrix-vector product: on CPU
    the reduced-precision GEMM path costs about twice torch.mv at one row (single-stream decode)."""
    one_row = x.dim() == 2 and x.shape[0] == 1
    if one_row and x.device.type == "cpu" and weight.dtype != torch.float32:
        out = torch.mv(weight, x[0]).unsqueeze(0)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


def run_linear(module: nn.Linear, x: torch.Tensor, decode_seqs: int) -> torch.Tensor:
    """One projection: in a decode step of a few sequences (`decode_seqs`, 0 for a prefill)
    with the GGUF's own 4-bit weights (see `attach_int4`), else through oneDNN with the weight
    prepacked (see `prepack_cpu_linears`) when it was, else `linear`.

    Prefill and extend steps never take the 4-bit weights, however few their tokens: a prompt
    whose prefix was cached leaves a short extend, and it must run through the same weights as
    the same prompt prefilled whole, or the two would answer differently. A speculative
    verification step is an extend with decode's weights: several rows per sequence, each
    computed as decoding it would (the 4-bit kernel computes each row alone)."""
    int4: Int4Weight | None = getattr(module, "berth_int4", None)
    if decode_seqs and int4 is not None and decode_seqs <= int4.max_rows:
        out = int4.matmul(x)
    elif module.weight is None and int4 is not None:  # the only copy (`prepack_cpu_linears`)
        out = packed_linear(x, int4.dequantized(module.berth_scratch))
    elif getattr(module, "berth_packed", False):
        out = packed_linear(x, module.weight)
    else:
        out = linear(x, module.weight, module.bias)
        return _with_lora(module, x, out)
    out = out if module.bias is None else out + module.bias
    return _with_lora(module, x, out)


def _with_lora(module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Add the LoRA adapters' updates of this step's rows (`lora.pool`), where it has any."""
    hook = getattr(module, "berth_lora", None)
    if hook is not None and hook.pool.active:
        hook.pool.add_delta(hook.layer, hook.projection, x, out)
    return out


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor) -> torch.Tensor:
    """x @ W.T through oneDNN, the weight prepacked (`pack_weight`) or plain [N, K] (then reordered
    on each call, with the same results). A row's result does not depend on how many rows come with
    it: oneDNN takes a different kernel for a single row, which rounds some outputs the other way,
    so one row runs as two (1.27x the projections' time: `make bench-same-answer`); and on CPUs
    with AMX, bf16 steps of many rows run in blocks (see `row_block`). Without this, a one-token
    extend after a cached prefix differs from the same token in a whole prefill, and bf16
    amplifies that difference over the layers into a different answer."""
    x = x.contiguous()
    rows = x.shape[0]
    if rows == 1:
        return _linear_pointwise(x.expand(2, -1).contiguous(), packed_weight)[:1]
    block = row_block(x.dtype)
    if block is not None and rows > block:
        return torch.cat([packed_linear(part, packed_weight) for part in x.split(block)])
    return _linear_pointwise(x, packed_weight)


# On a CPU with AMX, oneDNN runs a bf16 projection of more than 32 rows on AMX tiles, rounding
# differently from its kernel for fewer rows, and its choices above 32 rows vary with the shape
# again (measured on a Xeon with AMX: rows differ by up to 0.06; 1 to 32 rows agree bit for bit,
# as do all sizes in fp32 and on CPUs without AMX).
AMX_ROW_BLOCK = 32


@functools.cache
def row_block(dtype: torch.dtype) -> int | None:
    """The most rows one oneDNN call may take for each row's result to be independent of the
    others; None: any number."""
    capped = cpu_isa.isa_cap() is not None  # oneDNN then uses no AMX
    amx = not capped and bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    return AMX_ROW_BLOCK if amx and dtype == torch.bfloat16 else None


def _linear_pointwise(x: torch.Tensor, packed_weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, None, "none", [], "")


# Batch size oneDNN picks the packed layout for (measured: one layout serves 1..300 rows well).
PACK_BATCH_HINT = 32


def can_prepack_cpu_linears(dtype: torch.dtype, device: torch.device) -> bool:
    """bf16 and fp32 projections on CPU run through oneDNN with prepacked weights: faster than
    PyTorch's default CPU matmul at every size measured, and a row's result never depends on the
    other rows (MKL's fp32 kernels change with the row count: so would a cached prompt's answer)."""
    return (
        device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float32)
        and (dtype != torch.bfloat16 or cpu_isa.bf16_problem() is None)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
