"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, and sparse MoE MLPs in the
layers `decoder_sparse_step` and `mlp_only_layers` select (dense SwiGLU in the others)."""

from __future__ import annotations

from torch import nn

from berth_runtime.models.decoder import CausalLM, DecoderLayer
from berth_runtime.models.layers.mlp import GatedMLP, activation_of
from berth_runtime.models.layers.moe import SparseMoE
from berth_runtime.models.qwen3 import qwen3_attention


def is_sparse_layer(config, layer_id: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    return layer_id not in dense and config.num_experts > 0 and (layer_id + 1) % step == 0


class Qwen3MoeForCausalLM(CausalLM):
    cuda_graphs = False

    def build_layer(self, config, layer_id: int) -> nn.Module:
        activation = activation_of(config)
        mlp: nn.Module
        if is_sparse_layer(config, layer_id):
            mlp = SparseMoE(
                config.hidden_size,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                normalize_top_k=bool(config.norm_topk_prob),
                activation=activation,
            )
        else:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, activation=activation)
        return DecoderLayer(config, qwen3_attention(config, layer_id), mlp)
