"""CausalLM: the decoder stack every family shares (embedding, layers, final norm, lm_head), its
forward pass over the paged KV cache, its logits, and the loading of Hugging Face weights.

A family is a small subclass: which layer it builds (`build_layer`), how its checkpoint's names
map onto Berth's (`remap`), and what it changes at load (`adjust`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from berth_runtime.mem_cache.kv_pool import TokenToKVPool
from berth_runtime.model_executor import tensor_parallel
from berth_runtime.model_executor.forward_batch import ForwardBatch
from berth_runtime.models.cpu_weights import CpuWeightPaths
from berth_runtime.models.int8_lm_head import Int8LmHead
from berth_runtime.models.layers.attention import Attention
from berth_runtime.models.layers.linear import linear, packed_linear
from berth_runtime.models.layers.logits import exact_top_logits
from berth_runtime.models.layers.mlp import GatedMLP
from berth_runtime.models.layers.moe import SparseMoE
from berth_runtime.models.layers.norm import RMSNorm
from berth_runtime.models.layers.rotary import RopeTables, RotaryEmbedding

# Checkpoint projection -> (Berth's fused projection, its part), as in every Llama-like family.
FUSED_PARTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DecoderLayer(nn.Module):
    """A pre-norm layer: x + attn(norm(x)), then + mlp(norm(...)). `mlp` is a GatedMLP or a
    SparseMoE (both take the step's `decode_seqs`)."""

    def __init__(self, config, attention: Attention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        rope: RopeTables,
        kv_pool: TokenToKVPool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the caller, or the next
        layer's norm, adds the two, so each residual add is fused into a norm."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, batch, rope, kv_pool)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, batch.decode_seqs), residual


class CausalLM(CpuWeightPaths, nn.Module):
    """The decoder stack: `forward` gives final hidden states, `compute_logits` vocab scores."""

    # MoE layers group tokens by expert on the host: no CUDA graph can hold that step.
    cuda_graphs = True

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        # The vocabulary rows this process holds (all of them without tensor parallelism).
        tp = tensor_parallel.current()
        self.vocab = tp.part(config.vocab_size)
        self.vocab_widths = [
            len(tensor_parallel.TPGroup(r, tp.size).part(config.vocab_size)) for r in range(tp.size)
        ]
        self.embed_tokens = nn.Embedding(len(self.vocab), config.hidden_size)
        layers = range(config.num_hidden_layers)
        self.layers = nn.ModuleList(self.build_layer(config, i) for i in layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, len(self.vocab), bias=False)
        self.prepacked = False  # set by prepack_cpu_linears
        self.packed_lm_head: torch.Tensor | None = None
        self.int8_lm_head: Int8LmHead | None = None  # set by attach_int8_lm_head
        self.fused_decode_rows = 0  # set by enable_fused_decode
        self.fused_decode_weights: list[torch.Tensor] = []
        self.use_cpu_logit_kernels = False  # set by enable_cpu_kernels
        # LoRA (`lora.pool.attach`): the pool whose step may give rows adapter updates.
        self.lora_pool = None
        # Gemma 2: vocab scores pass through cap * tanh(score / cap).
        self.final_logit_softcap: float | None = getattr(config, "final_logit_softcapping", None)

    def build_layer(self, config, layer_id: int) -> nn.Module:
        raise NotImplementedError

    def rebuild_buffers(self, device: torch.device) -> None:
        """Compute the rotary tables on `device` (a model built on the meta device has none)."""
        self.rotary.rebuild(device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_lookup(input_ids)

    def embed_lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embedding rows; with tensor parallelism each process looks up the ids in
        its share of the vocabulary (zeros for the rest), and the shares are summed."""
        if len(self.vocab) == self.config.vocab_size:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab.start
        inside = (local >= 0) & (local < len(self.vocab))
        rows = self.embed_tokens(local.clamp(0, len(self.vocab) - 1))
        return tensor_parallel.all_reduce(rows * inside.unsqueeze(-1).to(rows.dtype))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_pool: TokenToKVPool) -> torch.Tensor:
        hidden = self.embed(batch.input_ids)
        rope = self.rotary.tables(batch.positions, hidden.dtype)
        adapted = self.lora_pool is not None and self.lora_pool.active
        if batch.is_decode and 0 < batch.decode_seqs <= self.fused_decode_rows and not adapted:
            # The same ops as the layers below, dispatched from C++ (see `enable_fused_decode`).
            attn = self.layers[0].self_attn
            return torch.ops.berth.decode_layers(
                hidden,
                *rope,
                kv_pool.kv_buffer,
                batch.out_cache_loc,
                batch.kv_indices,
                batch.seq_lens,
                self.fused_decode_weights,
                attn.num_heads,
                attn.num_kv_heads,
                self.layers[0].mlp.intermediate_size,
                self.norm.eps,
                attn.scale,
            )
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, batch, rope, kv_pool)
        return self.norm(hidden, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 vocab scores [rows, V]: the lm_head in the model's dtype (or, for small steps,
        on its 8-bit copy, fp32 models included), then each row's top candidates computed again
        exactly (see `exact_top_logits`); an fp32 lm_head's scores are exact already."""
        weight = self.lm_head_weight()
        head8 = self.int8_lm_head
        approximate = head8 is not None and hidden.shape[0] <= head8.max_rows
        if approximate:  # int8 scores, in bf16 or fp32: candidates only
            logits = head8.scores(hidden)
        elif self.prepacked:  # the packed copy, or the plain weight beside an 8-bit one
            head = self.packed_lm_head if self.packed_lm_head is not None else weight
            logits = packed_linear(hidden, head)
        else:
            logits = linear(hidden, weight)
        if logits.dtype != torch.float32 or approximate:
            logits = exact_top_logits(logits, hidden, weight, self.use_cpu_logit_kernels)
        if self.final_logit_softcap:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        # Tensor parallelism: each process scored its share of the vocabulary.
        return tensor_parallel.gather_columns(logits, self.vocab_widths)

    def lm_head_weight(self) -> torch.Tensor:
        """The output projection [V, hidden] in plain layout (the tied embedding, if tied)."""
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def enable_cpu_kernels(self, attention: bool) -> None:
        """Run every RMSNorm, the exact logits (`exact_top_logits`), and attention when
        `attention`, on Berth's C++ CPU kernels (`berth_runtime.kernels.cpu`, loaded by the
        caller)."""
        self.use_cpu_logit_kernels = True
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.use_cpu_kernel = True
        for attn in self.attention_layers():
            attn.paged_attention = torch.ops.berth if attention else None

    def enable_triton_attention(self) -> None:
        """Run attention on the Triton paged kernels (`kernels.triton_attention`: CUDA, or CPU
        tensors under Triton's interpreter), which read K/V in place as the CPU kernels do, and
        MoE experts on the fused kernel (`kernels.triton_moe`)."""
        from berth_runtime.kernels import triton_attention

        for attn in self.attention_layers():
            attn.paged_attention = triton_attention
        moe_layers = [m for m in self.modules() if isinstance(m, SparseMoE)]
        for moe in moe_layers:
            moe.use_fused()
        if moe_layers:
            self.cuda_graphs = True  # the fused experts never read back to the host

    # --- weights ----------------------------------------------------------------------------

    def remap(self, name: str) -> str | None:
        """A checkpoint tensor's name (without `model.`) as Berth's modules name it; None for a
        tensor of a part Berth does not run (a multimodal checkpoint's vision tower)."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face tensors in: q/k/v and gate/up fused, experts stacked, each family's
        names mapped by `remap`; every parameter must be given."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = self.remap(hf_name.removeprefix("model."))
            if name is None or "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                # Tied checkpoints may store the shared matrix under either name.
                name = "embed_tokens.weight"
            if tensor_parallel.current().size > 1 and ".experts." not in name:
                tensor = self._share(name, tensor)  # experts: SparseMoE.load_expert
            loaded.add(self._load_one(params, name, hf_name, tensor))
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")

    def _load_one(
        self, params: dict[str, nn.Parameter], name: str, hf_name: str, tensor: torch.Tensor
    ) -> str:
        """Copy one tensor; returns the parameter it went into."""
        module_name, experts, expert_part = name.partition(".experts.")
        if experts:
            moe = self.get_submodule(module_name)
            if isinstance(moe, SparseMoE) and moe.load_expert(expert_part, tensor):
                stacked = "experts_down" if "down_proj" in expert_part else "experts_gate_up"
                return f"{module_name}.{stacked}"
        for part, (target, index) in FUSED_PARTS.items():
            if f".{part}." in name:
                fused = name.replace(part, target)
                if fused in params:
                    self._fused_slice(params[fused], fused, index).copy_(tensor)
                    return fused
        if name not in params:
            raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
        param = params[name]
        if param.shape != tensor.shape:
            raise ValueError(
                f"weight {hf_name!r} has shape {tuple(tensor.shape)}, the config asks for "
                f"{tuple(param.shape)}"
            )
        offset = getattr(self.get_submodule(name.rpartition(".")[0]), "weight_offset", 0.0)
        param.data.copy_(tensor + offset if offset else tensor)
        return name

    def _share(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This process's part of a whole checkpoint tensor (tensor parallelism; `name` as Berth
        names it): query/key/value heads and gate/up columns as rows, o_proj's and down_proj's
        as columns (their biases on process 0 only: the outputs are summed), the vocabulary's
        rows; the rest whole."""
        module_name, _, leaf = name.rpartition(".")
        owner_name, _, projection = module_name.rpartition(".")
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return tensor[self.vocab.start : self.vocab.stop]
        if not owner_name:
            return tensor
        owner = self.get_submodule(owner_name)
        if isinstance(owner, Attention):
            dim = owner.head_dim
            q = slice(owner.q_heads.start * dim, owner.q_heads.stop * dim)
            kv = slice(owner.kv_heads.start * dim, owner.kv_heads.stop * dim)
            if projection == "q_proj":
                return tensor[q]
            if projection in ("k_proj", "v_proj"):
                return tensor[kv]
            if projection == "qkv_proj":  # fused in the checkpoint (Phi-3)
                q_all = self.config.num_attention_heads * dim
                q_part, k_part, v_part = tensor.split(
                    [q_all, (tensor.shape[0] - q_all) // 2, (tensor.shape[0] - q_all) // 2]
                )
                return torch.cat((q_part[q], k_part[kv], v_part[kv]))
            if projection == "o_proj":
                return tensor[:, q] if leaf == "weight" else self._on_first(tensor)
        if isinstance(owner, GatedMLP):
            columns = slice(owner.inter.start, owner.inter.stop)
            if projection in ("gate_proj", "up_proj"):
                return tensor[columns]
            if projection == "gate_up_proj":  # fused in the checkpoint (Phi-3)
                gate, up = tensor.chunk(2)
                return torch.cat((gate[columns], up[columns]))
            if projection == "down_proj":
                return tensor[:, columns] if leaf == "weight" else self._on_first(tensor)
        return tensor

    @staticmethod
    def _on_first(bias: torch.Tensor) -> torch.Tensor:
        """A bias added after the processes' outputs are summed: process 0 adds it, alone."""
        return bias if tensor_parallel.current().rank == 0 else torch.zeros_like(bias)

    def _fused_slice(self, param: torch.Tensor, fused_name: str, index: int) -> torch.Tensor:
        """The rows of a fused projection's weight (or bias) that part `index` fills."""
        owner = self.get_submodule(fused_name.rsplit(".", 2)[0])  # the attention or the MLP
        if isinstance(owner, Attention):
            sizes = (owner.q_size, owner.kv_size, owner.kv_size)
        else:
            sizes = (owner.intermediate_size, owner.intermediate_size)
        return param.data.narrow(0, sum(sizes[:index]), sizes[index])
