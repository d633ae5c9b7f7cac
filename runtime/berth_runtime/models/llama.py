"""Llama and the families that share its layout: Llama 2/3.x (and SmolLM), Mistral, Qwen2."""

from __future__ import annotations

from torch import nn

from berth_runtime.models.decoder import CausalLM, DecoderLayer
from berth_runtime.models.layers.attention import Attention, layer_window
from berth_runtime.models.layers.mlp import GatedMLP, activation_of


class LlamaForCausalLM(CausalLM):
    """Pre-norm layers of attention (q/k/v biases for Qwen2, or where `attention_bias` says) and
    a SwiGLU MLP; Llama 3.1's and YaRN's RoPE scaling come from the config."""

    fused_decode_layout = True

    def build_layer(self, config, layer_id: int) -> nn.Module:
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        mlp = GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            bias=bool(getattr(config, "mlp_bias", False)),
            activation=activation_of(config),
        )
        window = layer_window(config, layer_id)  # Mistral 7B v0.1: every layer slides
        attention = Attention(config, layer_id, qkv_bias=bias, sliding_window=window)
        return DecoderLayer(config, attention, mlp)
