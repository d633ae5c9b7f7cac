"""Mixtral: Mistral's attention, and a sparse MoE MLP (top-2 of 8, renormalized) in every layer.
Its checkpoint names the MoE `block_sparse_moe` and an expert's projections w1 (gate), w3 (up)
and w2 (down)."""

from __future__ import annotations

from torch import nn

from berth_runtime.models.decoder import CausalLM, DecoderLayer
from berth_runtime.models.layers.attention import Attention, layer_window
from berth_runtime.models.layers.mlp import activation_of
from berth_runtime.models.layers.moe import SparseMoE

_EXPERT_PROJECTIONS = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


class MixtralForCausalLM(CausalLM):
    cuda_graphs = False

    def build_layer(self, config, layer_id: int) -> nn.Module:
        moe = SparseMoE(
            config.hidden_size,
            config.intermediate_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            normalize_top_k=True,
            activation=activation_of(config),
        )
        attention = Attention(config, layer_id, sliding_window=layer_window(config, layer_id))
        return DecoderLayer(config, attention, moe)

    def remap(self, name: str) -> str:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        for theirs, ours in _EXPERT_PROJECTIONS.items():
            name = name.replace(theirs, ours)
        return name
