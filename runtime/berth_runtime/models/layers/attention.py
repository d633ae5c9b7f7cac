"""Self-attention over the paged KV cache: fused q/k/v projection, optional QK-norm, rotary
embedding, then the backend's paged kernels (Berth's CPU kernels or Triton) or SDPA, over all of
each sequence or over a sliding window of it."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from berth_runtime.mem_cache.kv_pool import TokenToKVPool
from berth_runtime.model_executor import tensor_parallel
from berth_runtime.model_executor.forward_batch import ForwardBatch
from berth_runtime.models.layers.linear import run_linear
from berth_runtime.models.layers.norm import RMSNorm
from berth_runtime.models.layers.rotary import RopeTables, apply_rope, head_dim_of


def layer_window(config, layer_id: int) -> int | None:
    """The sliding window of layer `layer_id`, or None (it attends to everything): Gemma's
    `layer_types` interleave sliding and full layers; Mistral 7B v0.1 and Phi-3 slide in every
    layer; Qwen2/Qwen3 name a window they do not use (`use_sliding_window: false`)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    types = getattr(config, "layer_types", None)
    if types:
        return int(window) if types[layer_id] == "sliding_attention" else None
    return None if getattr(config, "use_sliding_window", True) is False else int(window)


# QK-norm: none, per head over its dims (Qwen3, Gemma 3), or over all heads at once (OLMo 2).
QKNorm = Literal["none", "per_head", "whole"]


class Attention(nn.Module):
    """One layer's attention. Checkpoint names: q_proj, k_proj and v_proj load into `qkv_proj`
    (see `CausalLM.load_weights`); q_norm and k_norm where the family has them."""

    def __init__(
        self,
        config,
        layer_id: int,
        *,
        qkv_bias: bool = False,
        qk_norm: QKNorm = "none",
        scale: float | None = None,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        norm_weight_offset: float = 0.0,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        tp = tensor_parallel.current()
        if qk_norm == "whole" and tp.size > 1:
            raise ValueError(
                "--tp-size > 1 cannot split this model's QK-norm over all heads at once (OLMo 2)"
            )
        # The heads this process holds (all of them without tensor parallelism).
        self.q_heads, self.kv_heads = tp.heads(
            config.num_attention_heads, config.num_key_value_heads
        )
        self.num_heads = len(self.q_heads)
        self.num_kv_heads = len(self.kv_heads)
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = scale if scale is not None else self.head_dim**-0.5
        # Each query attends to its last `sliding_window` positions only (None: all of them).
        self.sliding_window = sliding_window
        # Scores pass through cap * tanh(score / cap) before the softmax (Gemma 2): no fused
        # kernel computes that, so such a layer always attends through `_sdpa`'s eager form.
        self.logit_softcap = logit_softcap
        self.qk_norm = qk_norm
        eps = config.rms_norm_eps
        if qk_norm == "per_head":
            self.q_norm = RMSNorm(self.head_dim, eps, norm_weight_offset)
            self.k_norm = RMSNorm(self.head_dim, eps, norm_weight_offset)
        elif qk_norm == "whole":
            self.q_norm = RMSNorm(self.q_size, eps)
            self.k_norm = RMSNorm(self.kv_size, eps)
        # Paged attention ops (decode_attention, extend_attention): torch.ops.berth on CPU
        # (enable_cpu_kernels) or kernels.triton_attention (enable_triton_attention); None: SDPA.
        self.paged_attention: Any = None

    @property
    def plain(self) -> bool:
        """Llama's attention exactly: what the fused CPU decode (`decode_layers`) computes."""
        return (
            self.qk_norm == "none"
            and self.qkv_proj.bias is None
            and self.sliding_window is None
            and self.logit_softcap is None
        )

    def _normed_qk(self, qkv: torch.Tensor) -> None:
        """Apply the QK-norm to the query and key heads of qkv [T, heads, D], in place."""
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if self.qk_norm == "per_head":
            qkv[:, :heads] = self.q_norm.norm(qkv[:, :heads])
            qkv[:, heads : heads + kv_heads] = self.k_norm.norm(qkv[:, heads : heads + kv_heads])
        elif self.qk_norm == "whole":
            tokens = qkv.shape[0]
            q = qkv[:, :heads].reshape(tokens, self.q_size)
            k = qkv[:, heads : heads + kv_heads].reshape(tokens, self.kv_size)
            qkv[:, :heads] = self.q_norm.norm(q).view(tokens, heads, -1)
            qkv[:, heads : heads + kv_heads] = self.k_norm.norm(k).view(tokens, kv_heads, -1)

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
        if self.qk_norm != "none":
            self._normed_qk(qkv)
        # Rotate the query and key heads in one go, in place, so that the new tokens' K and V
        # heads sit side by side in qkv, as in the cache (fewer ops: decode is overhead-bound).
        qk_heads = self.num_heads + self.num_kv_heads
        rotary = rope[0].shape[-1]
        if rotary == self.head_dim:
            qkv[:, :qk_heads] = apply_rope(qkv[:, :qk_heads], rope)
        else:  # partial rotary: the rest of each head passes through
            qkv[:, :qk_heads, :rotary] = apply_rope(qkv[:, :qk_heads, :rotary], rope)
        q = qkv[:, : self.num_heads]

        kv_cache = kv_pool.kv_buffer[self.layer_id]  # [slots, K heads + V heads, D]
        kv_cache.index_copy_(0, batch.out_cache_loc, qkv[:, self.num_heads :])
        if self.sliding_window is not None:
            out = self._windowed(q, kv_cache, batch, self.sliding_window)
        elif self.logit_softcap is not None:
            out = self._capped(q, kv_cache, batch)
        elif self.paged_attention is not None:
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
        else:
            out = self._sdpa(q, kv_cache, batch, batch.kv_indices, batch.attn_mask)
        out = run_linear(self.o_proj, out.reshape(num_tokens, self.q_size), batch.decode_seqs)
        return tensor_parallel.all_reduce(out)  # each process's heads' share of the output

    def _windowed(
        self, q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, window: int
    ) -> torch.Tensor:
        """Attention over each query's last `window` positions (itself included). A decode
        step reads the window's slots alone (`ForwardBatch.window`), on the paged kernels where
        they run; an extend gathers its sequences' K/V and masks a band (`band_mask`)."""
        kv_indices, lens = batch.window(window)
        if batch.is_decode:
            if self.paged_attention is not None and self.logit_softcap is None:
                return self.paged_attention.decode_attention(
                    q, kv_cache, kv_indices, lens, self.scale
                )
            key_pos = torch.arange(kv_indices.shape[1], device=q.device)
            mask = (key_pos[None, :] < lens[:, None])[:, None, None, :]
            return self._sdpa(q, kv_cache, batch, kv_indices, mask)
        return self._sdpa(q, kv_cache, batch, batch.kv_indices, batch.band_mask(window))

    def _capped(self, q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Full attention with soft-capped scores: SDPA's eager form over a causal mask."""
        if batch.is_decode:
            key_pos = torch.arange(batch.kv_indices.shape[1], device=q.device)
            mask = (key_pos[None, :] < batch.seq_lens[:, None])[:, None, None, :]
        else:
            mask = batch.band_mask(None)
        return self._sdpa(q, kv_cache, batch, batch.kv_indices, mask)

    def _sdpa(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: ForwardBatch,
        kv_indices: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """PyTorch's SDPA over the K/V of `kv_indices` [B, L] gathered from the pool, `mask`
        [B, 1, Q, L] (True: may attend); returns [T, H, D]."""
        # index_select on the flat slot axis is several times faster than advanced indexing.
        flat = kv_indices.reshape(-1)
        shape = (batch.batch_size, kv_indices.shape[1], 2 * self.num_kv_heads, -1)
        gathered = kv_cache.index_select(0, flat).view(shape)
        keys = gathered[:, :, : self.num_kv_heads].transpose(1, 2)  # [B, Hkv, L, D]
        values = gathered[:, :, self.num_kv_heads :].transpose(1, 2)

        if batch.is_decode:
            # One query per sequence: fold each KV head's query heads into its query positions,
            # [B, Hkv, H/Hkv, D], so attention reads K/V once per KV head (no GQA expansion);
            # the same result, about a quarter less time at batch 32.
            queries = q.reshape(batch.batch_size, self.num_kv_heads, -1, self.head_dim)
        else:
            assert mask is not None
            max_q = mask.shape[2]
            padded = q.new_zeros(batch.batch_size, max_q, self.num_heads, self.head_dim)
            padded[batch.query_batch_index, batch.query_pos_index] = q
            queries = padded.transpose(1, 2)  # [B, H, Q, D]
        if self.logit_softcap is not None:
            out = self._eager(queries, keys, values, mask, batch.is_decode)
        else:
            out = F.scaled_dot_product_attention(
                queries,
                keys,
                values,
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=not batch.is_decode,
            )
        if batch.is_decode:
            return out.reshape(q.shape)
        return out.transpose(1, 2)[batch.query_batch_index, batch.query_pos_index]

    def _eager(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        folded: bool,
    ) -> torch.Tensor:
        """softmax(cap * tanh(q k^T * scale / cap), masked) v, as transformers' eager attention
        computes it (softmax in fp32). `folded`: decode's queries [B, Hkv, H/Hkv, D] already sit
        with their KV head; else [B, H, Q, D], whose K/V heads are repeated to match."""
        assert self.logit_softcap is not None
        if not folded:
            groups = self.num_heads // self.num_kv_heads
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
        scores = torch.matmul(queries, keys.transpose(2, 3)) * self.scale
        scores = torch.tanh(scores / self.logit_softcap) * self.logit_softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype)
        return torch.matmul(weights, values)
