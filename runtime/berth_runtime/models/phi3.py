"""Phi-3 and Phi-4-mini: Llama's layout, with q/k/v and gate/up already fused in the checkpoint
(`qkv_proj`, `gate_up_proj`: loaded as they are), a sliding window in every layer (Phi-3-mini)
and, on Phi-4-mini, partial rotary."""

from __future__ import annotations

from torch import nn

from berth_runtime.models.decoder import CausalLM, DecoderLayer
from berth_runtime.models.layers.attention import Attention, layer_window
from berth_runtime.models.layers.mlp import GatedMLP, activation_of


class Phi3ForCausalLM(CausalLM):
    def build_layer(self, config, layer_id: int) -> nn.Module:
        mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, activation=activation_of(config)
        )
        attention = Attention(config, layer_id, sliding_window=layer_window(config, layer_id))
        return DecoderLayer(config, attention, mlp)
