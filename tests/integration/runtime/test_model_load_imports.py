"""Loading the model leaves PyTorch's compiler stack unloaded: the scheduler process never
compiles, and torch._dynamo with Triton would cost it about 45 MB of private memory and about 1 s
of start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "triton")

LOAD_AND_REPORT = f"""
import sys
from tests.integration.runtime.engine_steps import load_runner, prefill
runner = load_runner(max_total_tokens=512)
prefill(runner, [[1, 2, 3]])
print("imported:", [m for m in {COMPILER_MODULES!r} if m in sys.modules])
"""


def test_cpu_defaults_load_and_prefill_without_the_compiler_stack():
    paths = [str(REPO / p) for p in ("runtime", "common", "router", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_AND_REPORT],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "imported: []" in proc.stdout, proc.stdout
