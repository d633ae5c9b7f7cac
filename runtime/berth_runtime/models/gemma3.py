"""Gemma 3 (Gemma3ForCausalLM, as gemma-3-1b and 270m; and the language model of the multimodal
4B/12B/27B checkpoints): Gemma 2's layer (`gemma2`) with QK-norm instead of soft-capped scores,
sliding-window layers interleaved with global ones (`layer_types`, five to one), and a RoPE base
for each kind."""

from __future__ import annotations

import torch
from torch import nn

from berth_runtime.mem_cache.kv_pool import TokenToKVPool
from berth_runtime.model_executor.forward_batch import ForwardBatch
from berth_runtime.models.decoder import CausalLM
from berth_runtime.models.gemma2 import (
    FULL,
    NORM_OFFSET,
    SLIDING,
    GemmaDecoderLayer,
    scaled_embedding,
)
from berth_runtime.models.layers.norm import RMSNorm
from berth_runtime.models.layers.rotary import RotaryEmbedding


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__(config, max_positions)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, NORM_OFFSET)
        # The global layers' RoPE (`self.rotary` is the sliding layers').
        self.rotary_global = RotaryEmbedding(config, max_positions, FULL)
        self.rotary = RotaryEmbedding(config, max_positions, SLIDING)

    def build_layer(self, config, layer_id: int) -> nn.Module:
        return GemmaDecoderLayer(config, layer_id, qk_norm=True)

    def rebuild_buffers(self, device: torch.device) -> None:
        self.rotary.rebuild(device)
        self.rotary_global.rebuild(device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return scaled_embedding(self.embed_lookup(input_ids), self.config.hidden_size)

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


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a multimodal Gemma 3 checkpoint, text in and text out: its weights
    under `language_model.` (`model.language_model.` in newer saves); the vision tower and the
    projector are not loaded."""

    def remap(self, name: str) -> str | None:
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return None
        for prefix in ("language_model.model.", "language_model."):
            if name.startswith(prefix):
                return name.removeprefix(prefix)
        return name
