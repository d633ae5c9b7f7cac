"""Qwen3 (dense): Llama's layout with an RMSNorm on each query and key head before RoPE."""

from __future__ import annotations

from torch import nn

from berth_runtime.models.decoder import CausalLM, DecoderLayer
from berth_runtime.models.layers.attention import Attention, layer_window
from berth_runtime.models.layers.mlp import GatedMLP, activation_of


def qwen3_attention(config, layer_id: int) -> Attention:
    bias = bool(getattr(config, "attention_bias", False))
    window = layer_window(config, layer_id)
    return Attention(config, layer_id, qkv_bias=bias, qk_norm="per_head", sliding_window=window)


class Qwen3ForCausalLM(CausalLM):
    def build_layer(self, config, layer_id: int) -> nn.Module:
        mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, activation=activation_of(config)
        )
        return DecoderLayer(config, qwen3_attention(config, layer_id), mlp)
