"""RMSNorm, fused with the residual add on Berth's CPU kernels, and the QK-norm built on it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm, optionally after adding the residual stream: `forward(x, residual)` returns
    (norm(x + residual), x + residual), the pair each pre-norm decoder layer needs.

    Gemma's (1 + w) scale is stored as it is used: its loader adds the 1 (`weight_offset`), so
    every backend runs the same plain x * w kernel."""

    def __init__(self, hidden_size: int, eps: float, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.weight_offset = weight_offset  # added to the checkpoint's weight when loaded
        self.use_cpu_kernel = False  # set by CausalLM.enable_cpu_kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.use_cpu_kernel and x.dim() == 2:
            # One pass instead of PyTorch's decomposed bf16 norm (five kernels and an fp32 copy).
            if residual is None:
                return torch.ops.berth.rms_norm(x, self.weight, self.eps), x
            return torch.ops.berth.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps), x

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """norm(x) alone, over the last dimension of a tensor of any shape."""
        shape = x.shape
        return self(x.reshape(-1, shape[-1]))[0].view(shape)
