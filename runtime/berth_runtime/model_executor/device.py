"""Device and attention-backend rules: checked by `berth serve` before it starts anything, and
applied by the model runner once `auto` is resolved.

torch is imported where it is used: the API process checks the flags without loading it (unless
`--device cuda` asks it to look for a GPU).
"""

from __future__ import annotations

import importlib.util
import os
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


def resolved_device_type(device: str) -> str:
    """`resolve_device(device).type` (`cpu`, `cuda`), for a process without torch."""
    return resolve_device(device).type


def check_device(device: str) -> None:
    """Raise ValueError if `device` cannot be used here (for a check run in another process:
    a torch.device does not cross into one without torch)."""
    resolve_device(device)


def berth_cpu_required_by(
    attention_backend: str, deterministic: bool, speculative: bool = False
) -> str | None:
    """The flag that needs Berth's CPU kernels, as an error message's opening words, or None
    when `auto` may fall back to torch_native. Deterministic inference needs attention that
    computes each sequence alone; speculative decoding, attention that computes a verified
    token as decoding it would."""
    if attention_backend == "berth_cpu":
        return "--attention-backend berth_cpu"
    if deterministic:
        return "--enable-deterministic-inference (berth_cpu attention)"
    if speculative:
        return "--speculative-algorithm ngram (berth_cpu attention)"
    return None


def berth_cpu_problem(device: str, dtype: str) -> str | None:
    """Why Berth's CPU kernels cannot run on `device` (`cpu`, `cuda`; `auto` passes) in `dtype`
    (a --dtype value, `auto` included), or None. Whether they build here is the kernels' own
    question (`kernels.cpu.toolchain_problem`, `kernels.cpu.load`)."""
    if device == "cuda":
        return "runs on CPU only, not with --device cuda"
    if dtype not in ("auto", *DTYPES_BY_NAME):
        return f"takes float32 or bfloat16, not {dtype}"
    return None


def triton_problem(device: str) -> str | None:
    """Why Berth's Triton attention kernels cannot run on `device` (`cpu`, `cuda`; `auto` passes:
    the runner checks the device it resolved), or None."""
    if importlib.util.find_spec("triton") is None:
        return "needs Triton (it ships with PyTorch's CUDA builds)"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return (
            "runs on CUDA; on CPU tensors only under Triton's interpreter "
            "(TRITON_INTERPRET=1, for tests)"
        )
    return None
