"""The sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a softmax router picks each token's
top-k experts, and the experts run grouped, each once over all of its tokens; with Triton (CUDA),
all of them in one fused kernel (`kernels.triton_moe`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from berth_runtime.model_executor import tensor_parallel
from berth_runtime.models.layers.linear import packed_linear, run_linear
from berth_runtime.models.layers.mlp import Activation, gated


class SparseMoE(nn.Module):
    """out = sum over a token's top-k experts of weight * expert(x).

    Checkpoint names: `gate.weight` (the router), and per expert `experts.E.gate_proj`, `up_proj`
    and `down_proj` (or transformers 5's stacked `experts.gate_up_proj` and `experts.down_proj`),
    loaded into one [E, 2I, H] and one [E, H, I] tensor (see `load_expert`)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        normalize_top_k: bool,
        activation: Activation = "silu",
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k
        self.activation = activation
        # Each expert's intermediate columns this process holds (tensor parallelism: every
        # process runs every expert on its share of them).
        self.inter = tensor_parallel.current().part(intermediate_size)
        self.intermediate_size = intermediate_size = len(self.inter)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # Each expert's two weights in oneDNN's packed layout, replacing the stacked ones (see
        # `prepack`); empty until then.
        self.packed_gate_up = nn.ParameterList()
        self.packed_down = nn.ParameterList()
        # `kernels.triton_moe.fused_experts` when the model runs on Triton (`use_fused`).
        self.fused: Callable[..., torch.Tensor] | None = None

    def use_fused(self) -> None:
        """Run the experts through the fused Triton kernel: one launch per projection, no host
        sync (so the layer can be captured in a CUDA graph)."""
        from berth_runtime.kernels.triton_moe import fused_experts

        self.fused = fused_experts

    def route(self, x: torch.Tensor, decode_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [T, k] and their weights [T, k] (in x's dtype), as transformers
        computes them: softmax in fp32, top-k, optionally renormalized over the k."""
        logits = run_linear(self.gate, x, decode_seqs)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor, decode_seqs: int) -> torch.Tensor:
        return tensor_parallel.all_reduce(self._experts_of(x, decode_seqs))

    def _experts_of(self, x: torch.Tensor, decode_seqs: int) -> torch.Tensor:
        experts, weights = self.route(x, decode_seqs)
        if self.fused is not None:
            return self.fused(
                x, self.experts_gate_up, self.experts_down, experts, weights, self.activation
            )
        if x.shape[0] == 1:  # single-sequence decode: its k experts, nothing to group
            return self._one_token(x, experts[0], weights[0])
        # Group the (token, expert) pairs by expert: each expert that has tokens runs once, on
        # all of them.
        flat = experts.view(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        pair_weights = weights.view(-1)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start : start + count]
            start += count
            tokens = pairs // self.top_k
            y = self._expert(x[tokens], expert)
            out.index_add_(0, tokens, y * pair_weights[pairs].unsqueeze(-1))
        return out

    def _one_token(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        # In ascending expert order, as the grouped path (and transformers) add them up.
        chosen = sorted(zip(experts.tolist(), weights.unbind()), key=lambda pair: pair[0])
        out = None
        for expert, weight in chosen:
            y = self._expert(x, expert) * weight
            out = y if out is None else out + y
        assert out is not None
        return out

    def _expert(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        gate_up = self._project(x, expert, up=True)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self._project(gated(gate, up, self.activation), expert, up=False)

    def _project(self, x: torch.Tensor, expert: int, up: bool) -> torch.Tensor:
        if self.packed_gate_up:
            return packed_linear(x, (self.packed_gate_up if up else self.packed_down)[expert])
        return F.linear(x, (self.experts_gate_up if up else self.experts_down)[expert])

    @torch.inference_mode()
    def prepack(self, pack: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Give every expert its weights in oneDNN's packed layout (`layers.linear.pack_weight`),
        freeing the stacked ones: on CPU an expert's projection of a few rows then runs about
        1.7x faster than F.linear on a slice of the stack (measured on a Zen 4, bf16)."""
        if self.fused is not None:  # the fused kernel reads the stacked weights
            return
        for expert in range(self.num_experts):
            self.packed_gate_up.append(
                nn.Parameter(pack(self.experts_gate_up[expert]), requires_grad=False)
            )
            self.packed_down.append(
                nn.Parameter(pack(self.experts_down[expert]), requires_grad=False)
            )
        del self.experts_gate_up, self.experts_down

    def load_expert(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy one checkpoint tensor named relative to this layer's `experts.`; False if the name
        is not an expert weight."""
        size, inter = self.intermediate_size, self.inter
        columns = slice(inter.start, inter.stop)  # this process's share (tensor parallelism)
        if name == "gate_up_proj":  # stacked [E, 2I, H]
            gate, up = tensor.chunk(2, dim=1)
            self.experts_gate_up.data.copy_(torch.cat((gate[:, columns], up[:, columns]), dim=1))
            return True
        if name == "down_proj":  # stacked [E, H, I]
            self.experts_down.data.copy_(tensor[:, :, columns])
            return True
        index, _, part = name.partition(".")
        if not index.isdigit():
            return False
        expert = int(index)
        if part == "gate_proj.weight":
            self.experts_gate_up.data[expert, :size].copy_(tensor[columns])
        elif part == "up_proj.weight":
            self.experts_gate_up.data[expert, size:].copy_(tensor[columns])
        elif part == "down_proj.weight":
            self.experts_down.data[expert].copy_(tensor[:, columns])
        else:
            return False
        return True
