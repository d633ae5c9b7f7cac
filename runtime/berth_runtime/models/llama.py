"""Llama-family decoder (Llama, SmolLM, Mistral, Qwen2) reading its KV cache from the token pool.

Over 400 lines because the projections' three paths (oneDNN rows, 4-bit GGUF, exact fp32 logits)
belong to the layers that choose between them at each step."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from berth_runtime.mem_cache.kv_pool import TokenToKVPool
from berth_runtime.model_executor.forward_batch import ForwardBatch
from berth_runtime.models.gguf_q4 import Int4Weight
from berth_runtime.models.int8_lm_head import Int8LmHead
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
        return linear(x, module.weight, module.bias)
    return out if module.bias is None else out + module.bias


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor) -> torch.Tensor:
    """x @ W.T through oneDNN, the weight prepacked (`_pack`) or plain [N, K] (then reordered on
    each call, with the same results). A row's result does not depend on how many rows come with it:
    oneDNN takes a different kernel for a single row, which rounds some outputs the other way,
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


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


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


class RMSNorm(nn.Module):
    """RMSNorm, optionally after adding the residual stream: `forward(x, residual)` returns
    (norm(x + residual), x + residual), the pair each decoder layer needs."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_cpu_kernel = False  # set by LlamaForCausalLM.enable_cpu_kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.use_cpu_kernel:
            # One pass instead of PyTorch's decomposed bf16 norm (five kernels and an fp32 copy).
            if residual is None:
                return torch.ops.berth.rms_norm(x, self.weight, self.eps), x
            return torch.ops.berth.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps), x


def rope_inv_freq(config) -> torch.Tensor:
    """Inverse frequencies for rotary embeddings, with Llama 3 / linear scaling if configured."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    params = {**scaling, **params}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    head_dim = _head_dim(config)
    # On the CPU explicitly, also under a `torch.device("meta")` context: meta's arange is a
    # Python decomposition whose first use imports torch._dynamo and Triton (45 MB, about 1 s).
    even = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu")
    inv_freq = 1.0 / (theta ** (even / head_dim))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif rope_type != "default":
        raise ValueError(f"unsupported rope scaling type {rope_type!r}")
    return inv_freq.float()


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) rotary embedding with a precomputed cos/sin table."""

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        t = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos and signed sin of this step's positions over the full head dim, [T, 1, D];
        computed once per forward, read by every layer."""
        cos, sin = self.cos[positions], self.sin[positions]
        return (
            torch.cat((cos, cos), dim=-1).unsqueeze(1).to(dtype),
            torch.cat((-sin, sin), dim=-1).unsqueeze(1).to(dtype),
        )


RopeTables = tuple[torch.Tensor, torch.Tensor]


def apply_rope(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """Rotate-half RoPE on [T, heads, D]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), as
    x * cos + (x2, x1) * (-sin, sin): four kernels instead of seven, the same rounding."""
    cos, signed_sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * signed_sin


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5
        # Paged attention ops (decode_attention, extend_attention): torch.ops.berth on CPU
        # (enable_cpu_kernels) or kernels.triton_attention (enable_triton_attention); None: SDPA.
        self.paged_attention: Any = None

    def forward(
        self,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        rope: RopeTables,
        kv_pool: TokenToKVPool,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = run_linear(self.qkv_proj, hidden, batch.decode_seqs).view(
            num_tokens, -1, self.head_dim
        )
        # Rotate the query and key heads in one go, in place, so that the new tokens' K and V
        # heads sit side by side in qkv, as in the cache (fewer ops: decode is overhead-bound).
        qk_heads = self.num_heads + self.num_kv_heads
        qkv[:, :qk_heads] = apply_rope(qkv[:, :qk_heads], rope)
        q = qkv[:, : self.num_heads]

        kv_cache = kv_pool.kv_buffer[self.layer_id]  # [slots, K heads + V heads, D]
        kv_cache.index_copy_(0, batch.out_cache_loc, qkv[:, self.num_heads :])
        if self.paged_attention is not None:
            # Reads each sequence's K/V in place through its slots: no gather, no padding; every
            # token computed alone, so that caching and chunking cannot change its result.
            if batch.is_decode:
                out = self.paged_attention.decode_attention(
                    q, kv_cache, batch.kv_indices, batch.seq_lens, self.scale
                )
            else:
                out = self.paged_attention.extend_attention(
                    q,
                    kv_cache,
                    batch.kv_indices,
                    batch.query_batch_index,
                    batch.query_lens,
                    self.scale,
                )
            return run_linear(self.o_proj, out.view(num_tokens, self.q_size), batch.decode_seqs)
        # index_select on the flat slot axis is several times faster than advanced indexing.
        flat = batch.kv_indices.view(-1)
        shape = (batch.batch_size, batch.kv_indices.shape[1], 2 * self.num_kv_heads, -1)
        gathered = kv_cache.index_select(0, flat).view(shape)
        keys = gathered[:, :, : self.num_kv_heads].transpose(1, 2)  # [B, Hkv, L, D]
        values = gathered[:, :, self.num_kv_heads :].transpose(1, 2)

        if batch.is_decode:
            # One query per sequence: fold each KV head's query heads into its query positions,
            # [B, Hkv, H/Hkv, D], so attention reads K/V once per KV head (no GQA expansion);
            # the same result, about a quarter less time at batch 32.
            queries = q.reshape(batch.batch_size, self.num_kv_heads, -1, self.head_dim)
        else:
            max_q = batch.attn_mask.shape[2]
            padded = q.new_zeros(batch.batch_size, max_q, self.num_heads, self.head_dim)
            padded[batch.query_batch_index, batch.query_pos_index] = q
            queries = padded.transpose(1, 2)  # [B, H, Q, D]
        out = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=batch.attn_mask,
            scale=self.scale,
            enable_gqa=not batch.is_decode,
        )
        if batch.is_decode:
            out = out.reshape(num_tokens, self.q_size)
        else:
            out = out.transpose(1, 2)[batch.query_batch_index, batch.query_pos_index]
            out = out.reshape(num_tokens, self.q_size)
        return run_linear(self.o_proj, out, batch.decode_seqs)


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, decode_seqs: int) -> torch.Tensor:
        gate_up = run_linear(self.gate_up_proj, x, decode_seqs)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return run_linear(self.down_proj, F.silu(gate) * up, decode_seqs)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        rope: RopeTables,
        kv_pool: TokenToKVPool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the caller, or the next
        layer's norm, adds the two, so each residual add is fused into a norm."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, batch, rope, kv_pool)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, batch.decode_seqs), residual


class LlamaForCausalLM(nn.Module):
    """The decoder stack: `forward` gives final hidden states, `compute_logits` vocab scores."""

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.prepacked = False  # set by prepack_cpu_linears
        self.packed_lm_head: torch.Tensor | None = None
        self.int8_lm_head: Int8LmHead | None = None  # set by attach_int8_lm_head
        self.fused_decode_rows = 0  # set by enable_fused_decode
        self.fused_decode_weights: list[torch.Tensor] = []
        self.use_cpu_logit_kernels = False  # set by enable_cpu_kernels

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_pool: TokenToKVPool) -> torch.Tensor:
        hidden = self.embed_tokens(batch.input_ids)
        rope = self.rotary.tables(batch.positions, hidden.dtype)
        if batch.is_decode and 0 < batch.decode_seqs <= self.fused_decode_rows:
            # The same ops as the layers below, dispatched from C++ (see `enable_fused_decode`).
            attn = self.layers[0].self_attn
            return torch.ops.berth.decode_layers(
                hidden,
                *rope,
                kv_pool.kv_buffer,
                batch.out_cache_loc,
                batch.kv_indices,
                batch.seq_lens,
                self.fused_decode_weights,
                attn.num_heads,
                attn.num_kv_heads,
                self.layers[0].mlp.intermediate_size,
                self.norm.eps,
                attn.scale,
            )
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, batch, rope, kv_pool)
        return self.norm(hidden, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 vocab scores [rows, V]: the lm_head in the model's dtype (or, for small steps,
        on its 8-bit copy, fp32 models included), then each row's top candidates computed again
        exactly (see `exact_top_logits`); an fp32 lm_head's scores are exact already."""
        weight = self.lm_head_weight()
        head8 = self.int8_lm_head
        approximate = head8 is not None and hidden.shape[0] <= head8.max_rows
        if approximate:  # int8 scores, in bf16 or fp32: candidates only
            logits = head8.scores(hidden)
        elif self.prepacked:  # the packed copy, or the plain weight beside an 8-bit one
            head = self.packed_lm_head if self.packed_lm_head is not None else weight
            logits = packed_linear(hidden, head)
        else:
            logits = linear(hidden, weight)
        if logits.dtype == torch.float32 and not approximate:
            return logits
        return exact_top_logits(logits, hidden, weight, self.use_cpu_logit_kernels)

    def lm_head_weight(self) -> torch.Tensor:
        """The output projection [V, hidden] in plain layout (the tied embedding, if tied)."""
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def enable_cpu_kernels(self, attention: bool) -> None:
        """Run every RMSNorm, the exact logits (`exact_top_logits`), and attention when
        `attention`, on Berth's C++ CPU kernels (`berth_runtime.kernels.cpu`, loaded by the
        caller)."""
        self.use_cpu_logit_kernels = True
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.use_cpu_kernel = True
            elif isinstance(module, LlamaAttention):
                module.paged_attention = torch.ops.berth if attention else None

    def enable_triton_attention(self) -> None:
        """Run attention on the Triton paged kernels (`kernels.triton_attention`: CUDA, or CPU
        tensors under Triton's interpreter), which read K/V in place as the CPU kernels do."""
        from berth_runtime.kernels import triton_attention

        for layer in self.layers:
            layer.self_attn.paged_attention = triton_attention

    @torch.inference_mode()
    def prepack_cpu_linears(self) -> int:
        """Reorder every projection's weight (bf16 or fp32) once into oneDNN's blocked layout (after
        loading and `attach_int4`). Unpacked, oneDNN reorders the weight on every call: prepacked,
        batched decode projections run 1.2-1.9x faster, with bit-identical results. The packed
        tensor replaces the weight in place (same memory). The lm_head gets a packed copy and keeps
        its plain weight, whose rows `exact_top_logits` reads (a tied one is the embedding).

        Where Berth's int8 kernel runs the 4-bit weights, nothing is kept twice: a projection's
        bf16 weight is freed, and a step too large for the 4-bit kernel runs oneDNN on the bf16
        weight dequantized from the 4-bit one into a scratch buffer (`Int4Weight.dequantized`,
        bit for bit the freed weight: the same answers, for about 15 ms more per prefill pass on
        the embedded model); the lm_head gets no packed copy when the 8-bit one serves small steps.
        Returns the bytes freed."""
        freed = 0
        scratch_size = 0
        dequantized: list[nn.Linear] = []
        for module in self.modules():
            if not isinstance(module, nn.Linear) or module is getattr(self, "lm_head", None):
                continue
            int4: Int4Weight | None = getattr(module, "berth_int4", None)
            if int4 is not None and int4.integer and module.weight.dtype == torch.bfloat16:
                freed += module.weight.nbytes
                scratch_size = max(scratch_size, module.weight.numel())
                module.weight = None
                dequantized.append(module)
            else:
                module.weight = nn.Parameter(_pack(module.weight), requires_grad=False)
                module.berth_packed = True
        # One buffer for them all: a step runs its projections one at a time.
        scratch = torch.empty(scratch_size, dtype=torch.bfloat16) if dequantized else None
        for module in dequantized:
            module.berth_scratch = scratch
        if self.int8_lm_head is None:
            self.packed_lm_head = _pack(self.lm_head_weight())
        self.prepacked = True
        return freed - (scratch.nbytes if scratch is not None else 0)

    def enable_fused_decode(self) -> bool:
        """Run decode steps on the 4-bit weights through `torch.ops.berth.decode_layers`: every
        layer in one call from C++, bit for bit the ops of `forward`, without their Python
        dispatch (about a fifth of a single-stream step's time). Needs Berth's attention and RMSNorm
        kernels (`enable_cpu_kernels`), every projection in 4 bits (`attach_int4`) and no
        biases; returns whether it is on."""
        weights: list[torch.Tensor] = []
        rows = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            int4 = [getattr(p, "berth_int4", None) for p in projections]
            if attn.paged_attention is not torch.ops.berth or not self.norm.use_cpu_kernel:
                return False
            if any(w is None for w in int4) or any(p.bias is not None for p in projections):
                return False
            rows += [w.max_rows for w in int4]
            qkv, out, gate_up, down = int4
            weights += [
                layer.input_layernorm.weight,
                qkv.packed,
                qkv.scales_and_zeros,
                out.packed,
                out.scales_and_zeros,
                layer.post_attention_layernorm.weight,
                gate_up.packed,
                gate_up.scales_and_zeros,
                down.packed,
                down.scales_and_zeros,
            ]
        self.fused_decode_weights = [w.detach() for w in weights] + [self.norm.weight.detach()]
        self.fused_decode_rows = min(rows)
        return True

    @torch.inference_mode()
    def attach_int8_lm_head(self, max_rows: int) -> int:
        """Rank the vocabulary of steps of at most `max_rows` rows on an 8-bit copy of the
        lm_head (see `int8_lm_head`; bf16 models: the exact recomputation needs reduced-precision
        scores). Returns the bytes added, 0 where the shape does not fit."""
        weight = self.lm_head_weight()
        if not Int8LmHead.fits(weight):
            return 0
        self.int8_lm_head = Int8LmHead(weight.detach(), max_rows)
        return self.int8_lm_head.nbytes()

    @torch.inference_mode()
    def attach_int4(
        self, groups: dict[str, torch.Tensor], max_rows: int, integer: bool = False
    ) -> int:
        """Give each projection its 4-bit GGUF weight (see `gguf_q4`), used for steps of at most
        `max_rows` rows, where reading a quarter of the bytes beats bf16; larger steps keep the
        bf16 weight. `integer` packs them for Berth's int8 dot-product kernel (see
        `Int4Weight`). Fused q/k/v and gate/up concatenate their parts' rows. Returns the bytes
        added; a layer whose weights are not all in `groups` keeps bf16 only."""
        # Our projection -> the checkpoint projections it is made of, in row order.
        projections = {
            "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
            "self_attn.o_proj": ("self_attn.o_proj",),
            "mlp.down_proj": ("mlp.down_proj",),
        }
        added = 0
        for i, layer in enumerate(self.layers):
            for target, parts in projections.items():
                names = [f"model.layers.{i}.{part}.weight" for part in parts]
                if not all(f"{name}.codes" in groups for name in names):
                    continue
                weight = Int4Weight(
                    *(
                        torch.cat([groups[f"{name}.{field}"] for name in names])
                        for field in ("codes", "scales", "zeros")
                    ),
                    max_rows=max_rows,
                    integer=integer,
                )
                layer.get_submodule(target).berth_int4 = weight
                added += weight.nbytes()
        return added

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face tensors in, fusing q/k/v and gate/up projections."""
        params = dict(self.named_parameters())
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", 1),
            "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                # Tied checkpoints may store the shared matrix under either name.
                name = "embed_tokens.weight"
            for part, (target, index) in fused.items():
                if f".{part}." in name:
                    name = name.replace(part, target)
                    param = params[name]
                    self._fused_slice(param, target, index).copy_(tensor)
                    break
            else:
                if name not in params:
                    raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
                params[name].data.copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")

    def _fused_slice(self, param: torch.Tensor, target: str, index: int) -> torch.Tensor:
        if target == "gate_up_proj":
            size = self.config.intermediate_size
            return param.data.narrow(0, index * size, size)
        attn = self.layers[0].self_attn
        sizes = (attn.q_size, attn.kv_size, attn.kv_size)
        return param.data.narrow(0, sum(sizes[:index]), sizes[index])


# Qwen2 and Mistral share the Llama layout (Qwen2 adds q/k/v biases, read from the config).
MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
