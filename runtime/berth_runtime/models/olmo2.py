"""OLMo 2: norms after attention and after the MLP (not before), and QK-norm over all heads at
once, before RoPE."""

from __future__ import annotations

import torch
from torch import nn

from berth_runtime.mem_cache.kv_pool import TokenToKVPool
from berth_runtime.model_executor.forward_batch import ForwardBatch
from berth_runtime.models.decoder import CausalLM
from berth_runtime.models.layers.attention import Attention
from berth_runtime.models.layers.mlp import GatedMLP, activation_of
from berth_runtime.models.layers.norm import RMSNorm
from berth_runtime.models.layers.rotary import RopeTables


class Olmo2DecoderLayer(nn.Module):
    """x + post_attn_norm(attn(x)), then + post_ff_norm(mlp(...))."""

    def __init__(self, config, layer_id: int) -> None:
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = Attention(config, layer_id, qkv_bias=bias, qk_norm="whole")
        self.mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, activation=activation_of(config)
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

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
        attn = self.post_attention_layernorm(self.self_attn(hidden, batch, rope, kv_pool))[0]
        hidden = hidden + attn
        mlp = self.mlp(hidden, batch.decode_seqs)
        return self.post_feedforward_layernorm(mlp)[0], hidden


class Olmo2ForCausalLM(CausalLM):
    def build_layer(self, config, layer_id: int) -> nn.Module:
        return Olmo2DecoderLayer(config, layer_id)
