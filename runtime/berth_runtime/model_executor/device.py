"""Device and attention-backend rules: checked by `berth serve` before it starts anything, and
applied by the model runner once `auto` is resolved.

torch is imported where it is used: the API process checks the flags without loading it (unless
`--device cuda` asks it to look for a GPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from berth_runtime.kernels.cpu import DTYPES_BY_NAME

if TYPE_CHECKING:
    import torch


def resolve_device(device: str) -> torch.device:
    """`auto`: CUDA when there is a device, else the CPU; an explicit `cuda` must have one."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available")
    return torch.device(device)


def berth_cpu_problem(device: str, dtype: str) -> str | None:
    """Why Berth's CPU kernels cannot run on `device` (`cpu`, `cuda`; `auto` passes) in `dtype`
    (a --dtype value, `auto` included), or None. Whether they build here is the kernels' own
    question (`kernels.cpu.toolchain_problem`, `kernels.cpu.load`)."""
    if device == "cuda":
        return "runs on CPU only, not with --device cuda"
    if dtype not in ("auto", *DTYPES_BY_NAME):
        return f"takes float32 or bfloat16, not {dtype}"
    return None
