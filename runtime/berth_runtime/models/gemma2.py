"""Gemma 2: sliding-window layers alternating with global ones, attention scores and final
logits soft-capped (cap * tanh(x / cap)), four norms a layer (before and after attention and the
MLP), (1 + w) RMSNorm scales, GeGLU, embeddings scaled by sqrt(hidden size), and the query scaled
by `query_pre_attn_scalar`. Its layer is Gemma 3's too."""

from __future__ import annotations

import torch
from torch import nn

from berth_runtime.mem_cache.kv_pool import TokenToKVPool
from berth_runtime.model_executor.forward_batch import ForwardBatch
from berth_runtime.models.decoder import CausalLM
from berth_runtime.models.layers.attention import Attention, layer_window
from berth_runtime.models.layers.mlp import GatedMLP, activation_of
from berth_runtime.models.layers.norm import RMSNorm
from berth_runtime.models.layers.rotary import RopeTables

# Gemma's RMSNorm scales by (1 + w): the checkpoint's w, plus one at load (`RMSNorm`).
NORM_OFFSET = 1.0
SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaDecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then + post_ff_norm(mlp(pre_ff_norm(...))):
    Gemma 2's layer, and Gemma 3's with `qk_norm`."""

    def __init__(self, config, layer_id: int, *, qk_norm: bool) -> None:
        super().__init__()
        window = layer_window(config, layer_id)
        self.layer_type = SLIDING if window is not None else FULL
        self.self_attn = Attention(
            config,
            layer_id,
            qkv_bias=bool(getattr(config, "attention_bias", False)),
            qk_norm="per_head" if qk_norm else "none",
            scale=config.query_pre_attn_scalar**-0.5,
            sliding_window=window,
            logit_softcap=getattr(config, "attn_logit_softcapping", None),
            norm_weight_offset=NORM_OFFSET,
        )
        self.mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, activation=activation_of(config)
        )
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, NORM_OFFSET)
        self.post_attention_layernorm = RMSNorm(size, eps, NORM_OFFSET)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, NORM_OFFSET)
        self.post_feedforward_layernorm = RMSNorm(size, eps, NORM_OFFSET)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        rope: RopeTables,
        kv_pool: TokenToKVPool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as `DecoderLayer`: (the output to add, the residual stream)."""
        if residual is not None:
            hidden = hidden + residual
        attn = self.self_attn(self.input_layernorm(hidden)[0], batch, rope, kv_pool)
        hidden = hidden + self.post_attention_layernorm(attn)[0]
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden)[0], batch.decode_seqs)
        return self.post_feedforward_layernorm(mlp)[0], hidden


class Gemma2ForCausalLM(CausalLM):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__(config, max_positions)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, NORM_OFFSET)

    def build_layer(self, config, layer_id: int) -> nn.Module:
        return GemmaDecoderLayer(config, layer_id, qk_norm=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return scaled_embedding(self.embed_lookup(input_ids), self.config.hidden_size)


def scaled_embedding(hidden: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """Gemma's embedding times sqrt(hidden size), the scale rounded to its dtype first (as
    transformers does)."""
    return hidden * torch.tensor(hidden_size**0.5, dtype=hidden.dtype)
