"""Paged attention for CUDA in Triton: decode and extend read K/V in place through slot indices.

The GPU counterpart of `torch.ops.berth.decode_attention` / `extend_attention` (cpu_kernels.cpp),
with the same signatures and semantics: `kv` is one layer of the token-slot pool,
[slots, 2 * Hkv, D] (a slot's K heads then its V heads), `kv_indices` [B, L] int64 the slot of
each position of each sequence (a row of ReqToTokenPool.req_to_token), and each query reads only
its own sequence's first `len` slots where they lie: no gather into a padded copy.

How the model calls them (the backend wiring is not in this module): exactly where Attention
calls torch.ops.berth.decode_attention / extend_attention, with the same arguments, after the
step's K/V were written into the pool (kv_cache.index_copy_(0, out_cache_loc, ...)):
    * decode: `decode_attention(q, kv_cache, batch.kv_indices, batch.seq_lens, scale)`;
    * extend / prefill / chunk: `extend_attention(q, kv_cache, batch.kv_indices,
      batch.query_batch_index, batch.query_lens, scale)`, query_lens = position + 1 (causal,
      cached prefix included); a sequence's tokens consecutive in T;
    * q may be the view qkv[:, :H] (any strides, unit stride on D); the output is a new
      contiguous [tokens, H, D]; fp32, bf16 or fp16 (q and kv alike); head dims 64, 128, 256;
      any H % Hkv == 0; all on one CUDA device;
    * no host sync and no data-dependent shape: a launch of (tokens x Hkv) programs, so decode
      can be captured in a CUDA graph (it allocates only its output and an arange(B)).
CPU tensors run only through Triton's interpreter, which is how CI tests these kernels without a
GPU: TRITON_INTERPRET=1 must be set before Triton is imported (Triton wraps its own library
functions for the interpreter or the GPU at import; this module wraps its kernel at first use).

Kernel design. One kernel serves both ops; decode is an extend whose tokens are each their own
sequence (query_seq = arange(B)), so a token goes through the same compiled kernel, with the same
compile-time constants, in either op. Grid (T, Hkv). Program (t, g) computes a *block*: token t
and the up to BLOCK_M - 1 following tokens of the same sequence at consecutive positions, for
the GROUP query heads that share KV head g; rows of the block are (token, head) pairs, BLOCK_M *
BLOCK_H of them (BLOCK_H = GROUP rounded up to a power of two; BLOCK_M * BLOCK_H = 32, or
BLOCK_H when the group is larger), so one K/V tile load feeds every row. Blocks are aligned on
absolute positions (a block starts where position % BLOCK_M == 0, at a new sequence, or at a break
in positions); a program whose token does not start a block does nothing. Each block walks its
sequence's slots in tiles of BLOCK_N positions aligned on absolute position 0, BLOCK_N, ...: load
the tile's slot numbers, the K tile (gathered rows of the pool), scores = q . K^T in fp32, mask
positions >= the row's own length with -inf, online softmax (running max, rescale, exp2), P . V
accumulated in fp32; the output is acc / l rounded once to the storage dtype. No split-KV.
Precision: q . K^T multiplies the stored values exactly (16-bit products are exact in fp32
accumulators); in bf16/fp16, P enters P . V as two 16-bit terms (P's rounding and the rounding of
its remainder: 16 significant bits in bf16, 22 in fp16) instead of FlashAttention's one, which
makes the error smaller than SDPA's in that dtype (tested) for a third MMA per tile; fp32 uses
IEEE fp32 products (not TF32).

Why a token's result does not depend on the rest of the call. For one row (token, head) the
arithmetic is a function of that row's q, its sequence's slots and its own length only:
    * tiles sit on absolute positions and are visited in the same order, whatever the block;
    * positions past the row's length are masked to -inf before the max, so they give p = 0,
      and a tile wholly past it (when another row of its block is longer) leaves the state
      exactly as it was: max unchanged, alpha = exp2(0) = 1, l + 0, acc * 1 + 0 (the K/V it
      loads are real slots of the sequence: finite);
    * rows that are not real tokens (past the block, heads past the group) read no q and get a
      length of 1: finite, never stored, never mixed into other rows;
    * block shape, tile size, warps and stages depend only on (dtype, head dim, group): the
      model's constants, never on the batch, its lengths or T; no autotuning; the integer
      arguments that vary per call are not specialized on, so every call runs one binary (q
      and the pool keep Triton's 16-byte alignment specialization: their rows are aligned at
      every head dim here, so only an odd view would select another, equally exact, binary).
In the interpreter this gives bit-identical results in a decode step, a whole prefill, an extend
after a cached prefix and any chunking (tested). On a GPU it rests on two things Triton does not
promise but NVIDIA's MMA instructions (mma.sync, wgmma) do in practice: an output element of a
tile product is computed from its own row and column only, in an order fixed by the compiled
instruction sequence, not by its row's place in the tile; and one binary does the same
floating-point operations each run (no atomics, no split reductions here). What is NOT
guaranteed: equality with the CPU kernels, with SDPA or with the interpreter (other summation
orders; a GPU's exp2 is ex2.approx), equality across GPU architectures, Triton, ptxas or driver
versions, or between two specializations (a different dtype, head dim or group). The GPU side of
the property is by construction here; `test_on_the_gpu` (marked gpu) checks it on hardware.

Costs of that choice: decode computes BLOCK_M * BLOCK_H rows for GROUP useful ones (tensor-core
work is cheap next to the K/V reads that bound decode); a long context at batch 1 is one
program per KV head walking every tile (no split-KV, whose split points would have to be fixed
absolute positions shared by decode and extend to keep the property); an extend launches T
programs per KV head of which about one in BLOCK_M works. Nothing here is timed yet: tile sizes
and warps come from the register and shared-memory use of sm_80/sm_90 builds.

Why one module of ~400 lines, most of it this note: the kernel, its launch configuration and the
two ops must agree on block shapes and compile-time constants, on which the property above rests.
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:  # Triton ships with the CUDA builds of PyTorch; without it only these kernels are missing.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - every supported torch build has it
    triton = None
    tl = None

HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (token, head) rows per program: the smallest tile M tensor cores take is 16; 32 lets an extend
# block share each K/V tile between more tokens at a small cost to decode.
BLOCK_ROWS = 32


def _attention_kernel(
    Q,
    KV,
    KVIndices,
    QuerySeq,
    QueryLens,
    Out,
    qk_scale,
    num_tokens,
    width,
    stride_q_token,
    stride_q_head,
    stride_kv_slot,
    stride_kv_head,
    stride_idx_seq,
    stride_o_token,
    stride_o_head,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
    SPLIT_P: tl.constexpr,
):
    """Program (token, kv_head): the block of consecutive tokens starting at `token` (if one
    starts there) x the query heads of `kv_head`. See the module docstring."""
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(QuerySeq + token)
    length = tl.load(QueryLens + token)
    # A token continues the block of the token before it when it is the next position of the
    # same sequence and not on a block boundary (position % BLOCK_M == 0): that block's program
    # computes it, this one has nothing to do.
    prev = tl.maximum(token - 1, 0)
    continues = (token > 0) & ((length - 1) % BLOCK_M != 0)
    continues = continues & (tl.load(QuerySeq + prev) == seq)
    continues = continues & (tl.load(QueryLens + prev) + 1 == length)
    if continues:
        return

    # Rows: (token offset m in the block, head h in the group). The block ends before the
    # first later token that does not continue it.
    rows = tl.arange(0, BLOCK_M * BLOCK_H)
    m = rows // BLOCK_H
    h = rows % BLOCK_H
    tok = token.to(tl.int64) + m
    later = (m > 0) & (tok < num_tokens)
    tok_seq = tl.load(QuerySeq + tok, mask=later, other=-1)
    tok_len = tl.load(QueryLens + tok, mask=later, other=-1)
    prev_len = tl.load(QueryLens + tok - 1, mask=later, other=-1)
    prev_seq = tl.load(QuerySeq + tok - 1, mask=later, other=-1)
    later = later & (tok_seq == seq) & (prev_seq == seq) & (prev_len + 1 == tok_len)
    later = later & ((tok_len - 1) % BLOCK_M != 0)  # so tok_len == length + m in a block
    block_end = tl.min(tl.where((m > 0) & ~later, m, BLOCK_M), axis=0)
    valid = (m < block_end) & (h < GROUP)
    # The block's tokens are at consecutive positions: token m attends length + m slots. Rows
    # that are not real tokens attend position 0 (finite, never stored).
    lens = tl.where(valid, length + m, 1)
    max_len = tl.minimum(length + block_end - 1, width)

    d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + h
    q = tl.load(
        Q + tok[:, None] * stride_q_token + head[:, None] * stride_q_head + d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    if UPCAST:  # the interpreter has no bf16 matmul: fp32 products of bf16 values are exact
        q = q.to(tl.float32)

    slot_row = KVIndices + seq.to(tl.int64) * stride_idx_seq
    k_base = KV + kv_head * stride_kv_head
    v_base = KV + (NUM_KV_HEADS + kv_head) * stride_kv_head
    m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for start in range(0, max_len, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        in_block = pos < max_len
        slots = tl.load(slot_row + pos, mask=in_block, other=0).to(tl.int64)
        offsets = slots[:, None] * stride_kv_slot + d[None, :]
        k = tl.load(k_base + offsets, mask=in_block[:, None], other=0.0)
        v = tl.load(v_base + offsets, mask=in_block[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        scores = tl.where(pos[None, :] < lens[:, None], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if UPCAST:  # (interpreter, bf16) P rounded to bf16 to nearest even, as a GPU rounds it
            v = v.to(tl.float32)
            bits = p.to(tl.uint32, bitcast=True)
            p_hi = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        else:
            p_hi = p.to(v.dtype)
        acc = tl.dot(p_hi, v, acc, input_precision="ieee")
        if SPLIT_P:  # P's remainder in a second 16-bit product (module docstring: Precision)
            rest = p - p_hi.to(tl.float32)
            if UPCAST:
                bits = rest.to(tl.uint32, bitcast=True)
                p_lo = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(
                    tl.float32, bitcast=True
                )
            else:
                p_lo = rest.to(v.dtype)
            acc = tl.dot(p_lo, v, acc, input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i is 0 only in idle programs
    if UPCAST:  # the interpreter truncates fp32 -> bf16: round to nearest even first
        bits = out.to(tl.uint32, bitcast=True)
        out = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(
        Out + tok[:, None] * stride_o_token + head[:, None] * stride_o_head + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=valid[:, None],
    )


# The arguments that change from call to call are not specialized on, so that a model runs one
# binary whatever the batch (and Triton compiles nothing new while serving): the token count
# (else 1 and multiples of 16 get their own variants), kv_indices' width and row stride, and the
# alignment of the index tensors (slices of a larger buffer).
_PER_CALL_ARGS = ("num_tokens", "width", "stride_idx_seq")
_PER_CALL_POINTERS = ("KVIndices", "QuerySeq", "QueryLens")
_kernels: dict[bool, Any] = {}


def interpreting() -> bool:
    """Whether Triton runs kernels through its interpreter now (TRITON_INTERPRET)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def kernel(interpret: bool | None = None) -> Any:
    """The jitted kernel for the interpreter or for the GPU (by default: whichever TRITON_INTERPRET
    says now). triton.jit picks one when it wraps a function, so the wrapping is done per mode on
    first use, not at import."""
    if triton is None:
        raise RuntimeError("Triton is not installed: the Triton attention kernels are unavailable")
    mode = interpreting() if interpret is None else interpret
    if mode not in _kernels:
        if mode != interpreting():
            raise RuntimeError(f"TRITON_INTERPRET must be {int(mode)} to build this kernel")
        if mode and not library_interpreted():
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after Triton was imported: Triton's own library "
                "(tl.max, tl.sum, ...) was built for the GPU then; set it before importing Triton"
            )
        _kernels[mode] = triton.jit(
            _attention_kernel,
            do_not_specialize=_PER_CALL_ARGS,
            do_not_specialize_on_alignment=_PER_CALL_POINTERS,
        )
    return _kernels[mode]


def library_interpreted() -> bool:
    """Whether triton.language's own jitted functions were wrapped for the interpreter (they are
    wrapped once, when Triton is imported)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - another Triton layout: let the launch tell
        return True
    return isinstance(tl.max, InterpretedFunction)


def launch_config(dtype: torch.dtype, head_dim: int, group: int) -> dict[str, Any]:
    """Compile-time constants and launch options: functions of the model's shape only, never of
    the batch (a token's arithmetic must not depend on what it is batched with)."""
    block_h = triton.next_power_of_2(group)
    rows = max(BLOCK_ROWS, block_h)
    # K and V tiles of 128 to 256 B a row x BLOCK_N rows, double-buffered. Chosen from the
    # register and shared-memory use of sm_80/sm_90 builds (no spills), not from timings.
    row_bytes = head_dim * dtype.itemsize
    block_n = 64 if row_bytes <= 256 else 32 if row_bytes <= 512 else 16
    return {
        "GROUP": group,
        "BLOCK_H": block_h,
        "BLOCK_M": rows // block_h,
        "BLOCK_N": block_n,
        "HEAD_DIM": head_dim,
        "SPLIT_P": dtype != torch.float32,
        "num_warps": 8 if dtype == torch.float32 or head_dim > 128 or rows > BLOCK_ROWS else 4,
        "num_stages": 2,
    }


def _check_inputs(q: torch.Tensor, kv: torch.Tensor, kv_indices: torch.Tensor) -> None:
    """The CPU kernels' checks, as ValueError."""
    if q.dim() != 3 or kv.dim() != 3 or kv.shape[2] != q.shape[2]:
        raise ValueError("bad q/kv shapes: q [tokens, H, D], kv [slots, 2 * Hkv, D]")
    if q.dtype != kv.dtype:
        raise ValueError(f"q and kv dtypes differ ({q.dtype}, {kv.dtype})")
    if q.dtype not in DTYPES:
        raise ValueError(f"Triton attention takes fp32, bf16 or fp16, not {q.dtype}")
    kv_heads = kv.shape[1] // 2
    if kv.shape[1] % 2 or kv_heads == 0 or q.shape[1] % kv_heads:
        raise ValueError(f"bad head counts: {q.shape[1]} query heads, {kv.shape[1]} K/V rows")
    if q.shape[2] not in HEAD_DIMS:
        raise ValueError(f"head dim must be 64, 128 or 256, not {q.shape[2]}")
    if kv_indices.dtype != torch.int64 or kv_indices.dim() != 2:
        raise ValueError("kv_indices must be int64 [sequences, max length]")
    if kv.stride(2) != 1:
        raise ValueError("kv must have unit stride on the head dim")
    if not q.device == kv.device == kv_indices.device:
        raise ValueError("q, kv and kv_indices are on different devices")


def launch_arguments(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_indices: torch.Tensor,
    query_seq: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    interpret: bool,
) -> tuple[tuple[int, int], tuple[Any, ...], dict[str, Any]]:
    """The kernel's grid, arguments and keyword arguments for checked inputs."""
    tokens, heads, head_dim = q.shape
    kv_heads = kv.shape[1] // 2
    args = (
        q,
        kv,
        kv_indices,
        query_seq,
        query_lens,
        out,
        float(scale) * 1.4426950408889634,  # log2(e): the softmax runs on exp2
        tokens,
        kv_indices.shape[1],
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        kv.stride(1),
        kv_indices.stride(0),
        out.stride(0),
        out.stride(1),
    )
    kwargs = {
        "NUM_KV_HEADS": kv_heads,
        "UPCAST": interpret and q.dtype == torch.bfloat16,
        **launch_config(q.dtype, head_dim, heads // kv_heads),
    }
    return (tokens, kv_heads), args, kwargs


def _attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_indices: torch.Tensor,
    query_seq: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    if q.stride(2) != 1:
        q = q.contiguous()
    if kv_indices.stride(1) != 1:
        kv_indices = kv_indices.contiguous()
    query_seq, query_lens = query_seq.contiguous(), query_lens.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    interpret = interpreting()
    if q.device.type == "cpu" and not interpret:
        raise RuntimeError(
            "Triton attention on CPU tensors runs only under Triton's interpreter: set "
            "TRITON_INTERPRET=1 before importing Triton"
        )
    grid, args, kwargs = launch_arguments(
        q, kv, kv_indices, query_seq, query_lens, scale, out, interpret
    )
    kernel(interpret)[grid](*args, **kwargs)
    return out


def decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, H, D]: one new token per sequence; kv [slots, 2 * Hkv, D]: one layer of the pool;
    kv_indices [B, L] int64; seq_lens [B] int64, 1..L. Sequence b's query attends over the slots
    kv_indices[b, :seq_lens[b]]; query head h reads KV head h // (H / Hkv). Returns [B, H, D].
    Runs as an extend of one token per sequence: the same kernel, the same bits."""
    _check_inputs(q, kv, kv_indices)
    if seq_lens.dtype != torch.int64:
        raise ValueError("seq_lens must be int64")
    if kv_indices.shape[0] != q.shape[0] or seq_lens.numel() != q.shape[0]:
        raise ValueError("kv_indices / seq_lens do not match the batch")
    rows = torch.arange(q.shape[0], dtype=torch.int64, device=q.device)
    return _attention(q, kv, kv_indices, rows, seq_lens, scale)


def extend_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_indices: torch.Tensor,
    query_seq: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D]: the new tokens of the sequences (rows of kv_indices [B, L]), a sequence's
    tokens consecutive; query_seq [T] int64: each token's row; query_lens [T] int64: the slots it
    attends to, its position + 1 (causal, cached prefix included). Returns [T, H, D]."""
    _check_inputs(q, kv, kv_indices)
    if query_seq.dtype != torch.int64 or query_lens.dtype != torch.int64:
        raise ValueError("query_seq and query_lens must be int64")
    if query_seq.numel() != q.shape[0] or query_lens.numel() != q.shape[0]:
        raise ValueError("query_seq / query_lens do not match the tokens")
    return _attention(q, kv, kv_indices, query_seq, query_lens, scale)
