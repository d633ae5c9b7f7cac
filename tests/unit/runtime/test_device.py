"""Device and attention-backend rules, shared by the launch prechecks and the model runner."""

from __future__ import annotations

import pytest
import torch

from berth_runtime.model_executor.device import berth_cpu_problem, resolve_device


def test_berth_cpu_runs_on_cpu_in_fp32_or_bf16() -> None:
    for device in ("auto", "cpu"):
        for dtype in ("auto", "float32", "bfloat16"):
            assert berth_cpu_problem(device, dtype) is None
    assert berth_cpu_problem("cuda", "auto") == "runs on CPU only, not with --device cuda"
    assert berth_cpu_problem("cpu", "float16") == "takes float32 or bfloat16, not float16"


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda was requested but no CUDA device"):
            resolve_device("cuda")
