"""Gemma 3 (text: Gemma3ForCausalLM, as gemma-3-1b and 270m): sliding-window layers interleaved
with global ones (`layer_types`), each kind with its own RoPE base, QK-norm, four norms a layer
(before and after attention and the MLP), (1 + w) RMSNorm scales, GeGLU, embeddings scaled by
sqrt(hidden size), and the query scaled by `query_pre_attn_scalar`."""

from __future__ import annotations

import torch
from torch import nn

from berth_runtime.mem_cache.kv_pool import TokenToKVPool
from berth_runtime.model_executor.forward_batch import ForwardBatch
from berth_runtime.models.decoder import CausalLM
from berth_runtime.models.layers.attention import Attention, layer_window
from berth_runtime.models.layers.mlp import GatedMLP, activation_of
from berth_runtime.models.layers.norm import RMSNorm
from berth_runtime.models.layers.rotary import RopeTables, RotaryEmbedding

# Gemma's RMSNorm scales by (1 + w): the checkpoint's w, plus one at load (`RMSNorm`).
NORM_OFFSET = 1.0
SLIDING, FULL = "sliding_attention", "full_attention"


class Gemma3DecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then + post_ff_norm(mlp(pre_ff_norm(...)))."""

    def __init__(self, config, layer_id: int) -> None:
        super().__init__()
        window = layer_window(config, layer_id)
        self.layer_type = SLIDING if window is not None else FULL
        self.self_attn = Attention(
            config,
            layer_id,
            qkv_bias=bool(getattr(config, "attention_bias", False)),
            qk_norm="per_head",
            scale=config.query_pre_attn_scalar**-0.5,
            sliding_window=window,
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


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__(config, max_positions)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, NORM_OFFSET)
        # The global layers' RoPE (`self.rotary` is the sliding layers').
        self.rotary_global = RotaryEmbedding(config, max_positions, FULL)
        self.rotary = RotaryEmbedding(config, max_positions, SLIDING)
        if getattr(config, "final_logit_softcapping", None):
            raise ValueError("Gemma 3 with final_logit_softcapping is not supported")

    def build_layer(self, config, layer_id: int) -> nn.Module:
        return Gemma3DecoderLayer(config, layer_id)

    def rebuild_buffers(self, device: torch.device) -> None:
        self.rotary.rebuild(device)
        self.rotary_global.rebuild(device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # As transformers: the scale rounded to the embedding's dtype first.
        return hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_pool: TokenToKVPool) -> torch.Tensor:
        hidden = self.embed(batch.input_ids)
        ropes = {
            SLIDING: self.rotary.tables(batch.positions, hidden.dtype),
            FULL: self.rotary_global.tables(batch.positions, hidden.dtype),
        }
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, batch, ropes[layer.layer_type], kv_pool)
        return self.norm(hidden, residual)[0]
