"""CpuWeightPaths: the CausalLM methods that give CPU projections their fast weights (oneDNN's
packed layout, the GGUF's 4-bit groups, an 8-bit lm_head) and the fused C++ decode step."""

from __future__ import annotations

import torch
from torch import nn

from berth_runtime.models.gguf_q4 import Int4Weight
from berth_runtime.models.int8_lm_head import Int8LmHead
from berth_runtime.models.layers.linear import pack_weight
from berth_runtime.models.layers.moe import SparseMoE


class CpuWeightPaths:
    """Mixed into `CausalLM` (whose attributes these methods read): each is called once, after
    the weights are loaded, by the ModelRunner."""

    layers: nn.ModuleList
    norm: nn.Module
    int8_lm_head: Int8LmHead | None
    packed_lm_head: torch.Tensor | None
    prepacked: bool
    fused_decode_rows: int
    fused_decode_weights: list[torch.Tensor]
    # Whether the family's layers are Llama's exactly (plain attention, SwiGLU MLP, pre-norms):
    # what `torch.ops.berth.decode_layers` computes.
    fused_decode_layout = False

    @torch.inference_mode()
    def prepack_cpu_linears(self) -> int:
        """Reorder every projection's weight (bf16 or fp32) once into oneDNN's blocked layout (after
        loading and `attach_int4`). Unpacked, oneDNN reorders the weight on every call: prepacked,
        batched decode projections run 1.2-1.9x faster, with bit-identical results. The packed
        tensor replaces the weight in place (same memory). The lm_head gets a packed copy and keeps
        its plain weight, whose rows `exact_top_logits` reads (a tied one is the embedding).

        Where Berth's int8 kernel runs the 4-bit weights, nothing is kept twice: a projection's
        bf16 weight is freed, and a step too large for the 4-bit kernel runs oneDNN on the bf16
        weight dequantized from the 4-bit one into a scratch buffer (`Int4Weight.dequantized`,
        bit for bit the freed weight: the same answers, for about 15 ms more per prefill pass on
        the embedded model); the lm_head gets no packed copy when the 8-bit one serves small steps.
        Returns the bytes freed."""
        freed = 0
        scratch_size = 0
        dequantized: list[nn.Linear] = []
        for module in list(self.modules()):
            if isinstance(module, SparseMoE):
                module.prepack(pack_weight)
            if not isinstance(module, nn.Linear) or module is getattr(self, "lm_head", None):
                continue
            int4: Int4Weight | None = getattr(module, "berth_int4", None)
            if int4 is not None and int4.integer and module.weight.dtype == torch.bfloat16:
                freed += module.weight.nbytes
                scratch_size = max(scratch_size, module.weight.numel())
                module.weight = None
                dequantized.append(module)
            else:
                module.weight = nn.Parameter(pack_weight(module.weight), requires_grad=False)
                module.berth_packed = True
        # One buffer for them all: a step runs its projections one at a time.
        scratch = torch.empty(scratch_size, dtype=torch.bfloat16) if dequantized else None
        for module in dequantized:
            module.berth_scratch = scratch
        if self.int8_lm_head is None:
            self.packed_lm_head = pack_weight(self.lm_head_weight())
        self.prepacked = True
        return freed - (scratch.nbytes if scratch is not None else 0)

    def enable_fused_decode(self) -> bool:
        """Run decode steps on the 4-bit weights through `torch.ops.berth.decode_layers`: every
        layer in one call from C++, bit for bit the ops of `forward`, without their Python
        dispatch (about a fifth of a single-stream step's time). Needs Berth's attention and RMSNorm
        kernels (`enable_cpu_kernels`), every projection in 4 bits (`attach_int4`) and no
        biases; returns whether it is on."""
        if not self.fused_decode_layout:
            return False
        weights: list[torch.Tensor] = []
        rows = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            int4 = [getattr(p, "berth_int4", None) for p in projections]
            if attn.paged_attention is not torch.ops.berth or not self.norm.use_cpu_kernel:
                return False
            if any(w is None for w in int4) or any(p.bias is not None for p in projections):
                return False
            rows += [w.max_rows for w in int4]
            qkv, out, gate_up, down = int4
            weights += [
                layer.input_layernorm.weight,
                qkv.packed,
                qkv.scales_and_zeros,
                out.packed,
                out.scales_and_zeros,
                layer.post_attention_layernorm.weight,
                gate_up.packed,
                gate_up.scales_and_zeros,
                down.packed,
                down.scales_and_zeros,
            ]
        self.fused_decode_weights = [w.detach() for w in weights] + [self.norm.weight.detach()]
        self.fused_decode_rows = min(rows)
        return True

    @torch.inference_mode()
    def attach_int8_lm_head(self, max_rows: int) -> int:
        """Rank the vocabulary of steps of at most `max_rows` rows on an 8-bit copy of the
        lm_head (see `int8_lm_head`; bf16 models: the exact recomputation needs reduced-precision
        scores). Returns the bytes added, 0 where the shape does not fit."""
        weight = self.lm_head_weight()
        if not Int8LmHead.fits(weight):
            return 0
        self.int8_lm_head = Int8LmHead(weight.detach(), max_rows)
        return self.int8_lm_head.nbytes()

    @torch.inference_mode()
    def attach_int4(
        self, groups: dict[str, torch.Tensor], max_rows: int, integer: bool = False
    ) -> int:
        """Give each projection its 4-bit GGUF weight (see `gguf_q4`), used for steps of at most
        `max_rows` rows, where reading a quarter of the bytes beats bf16; larger steps keep the
        bf16 weight. `integer` packs them for Berth's int8 dot-product kernel (see
        `Int4Weight`). Fused q/k/v and gate/up concatenate their parts' rows. Returns the bytes
        added; a layer whose weights are not all in `groups` keeps bf16 only."""
        # Our projection -> the checkpoint projections it is made of, in row order.
        projections = {
            "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
            "self_attn.o_proj": ("self_attn.o_proj",),
            "mlp.down_proj": ("mlp.down_proj",),
        }
        added = 0
        for i, layer in enumerate(self.layers):
            for target, parts in projections.items():
                names = [f"model.layers.{i}.{part}.weight" for part in parts]
                if not all(f"{name}.codes" in groups for name in names):
                    continue
                weight = Int4Weight(
                    *(
                        torch.cat([groups[f"{name}.{field}"] for name in names])
                        for field in ("codes", "scales", "zeros")
                    ),
                    max_rows=max_rows,
                    integer=integer,
                )
                layer.get_submodule(target).berth_int4 = weight
                added += weight.nbytes()
        return added
