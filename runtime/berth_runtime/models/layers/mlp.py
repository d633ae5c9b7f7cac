"""The gated MLP (SwiGLU, or GeGLU with tanh-approximated GELU) with its gate and up projections
fused into one."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from berth_runtime.model_executor import tensor_parallel
from berth_runtime.models.layers.linear import run_linear

Activation = Literal["silu", "gelu_tanh"]


def activation_of(config) -> Activation:
    """The config's MLP activation (`hidden_act`, or `hidden_activation` for Gemma)."""
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if name in ("silu", "swish"):
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    raise ValueError(f"unsupported MLP activation {name!r} (supported: silu, gelu_pytorch_tanh)")


def gated(gate: torch.Tensor, up: torch.Tensor, activation: Activation) -> torch.Tensor:
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)). Checkpoint names gate_proj and up_proj load into
    `gate_up_proj` (see `CausalLM.load_weights`)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool = False,
        activation: Activation = "silu",
    ) -> None:
        super().__init__()
        # The intermediate columns this process holds (all of them without tensor parallelism).
        self.inter = tensor_parallel.current().part(intermediate_size)
        self.intermediate_size = intermediate_size = len(self.inter)
        self.activation = activation
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, decode_seqs: int) -> torch.Tensor:
        gate_up = run_linear(self.gate_up_proj, x, decode_seqs)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        out = run_linear(self.down_proj, gated(gate, up, self.activation), decode_seqs)
        return tensor_parallel.all_reduce(out)
