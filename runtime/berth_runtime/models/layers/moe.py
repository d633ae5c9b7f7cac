"""The sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a softmax router picks each token's
top-k experts, and the experts run grouped, each once over all of its tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from berth_runtime.models.layers.linear import run_linear
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
        self.intermediate_size = intermediate_size
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

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
        experts, weights = self.route(x, decode_seqs)
        # Group the (token, expert) pairs by expert: each expert that has tokens runs once, on
        # all of them. A decode step of one sequence runs its k experts and no other.
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
            gate_up = F.linear(x[tokens], self.experts_gate_up[expert])
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            y = F.linear(gated(gate, up, self.activation), self.experts_down[expert])
            out.index_add_(0, tokens, y * pair_weights[pairs].unsqueeze(-1))
        return out

    def load_expert(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy one checkpoint tensor named relative to this layer's `experts.`; False if the name
        is not an expert weight."""
        size = self.intermediate_size
        if name == "gate_up_proj":  # stacked [E, 2I, H]
            self.experts_gate_up.data.copy_(tensor)
            return True
        if name == "down_proj":  # stacked [E, H, I]
            self.experts_down.data.copy_(tensor)
            return True
        index, _, part = name.partition(".")
        if not index.isdigit():
            return False
        expert = int(index)
        if part == "gate_proj.weight":
            self.experts_gate_up.data[expert, :size].copy_(tensor)
        elif part == "up_proj.weight":
            self.experts_gate_up.data[expert, size:].copy_(tensor)
        elif part == "down_proj.weight":
            self.experts_down.data[expert].copy_(tensor)
        else:
            return False
        return True
