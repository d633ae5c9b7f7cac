"""The scheduler process keeps what it never uses out of memory: loading the model leaves PyTorch's
compiler stack unloaded (torch._dynamo with Triton: about 45 MB of private memory and 1 s of
start-up), and the model's config and tokenizer, read before torch is imported, leave out
transformers' model-loading code (torch.distributed.tensor and sympy: about 45 MB more)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

LOAD_AND_REPORT = """
import sys
from tests.integration.runtime.engine_steps import load_runner, prefill
runner = load_runner(max_total_tokens=512)
prefill(runner, [[1, 2, 3]])
print("imported:", [m for m in ("torch._dynamo", "torch._inductor", "triton") if m in sys.modules])
"""

READ_FILES_THEN_TORCH = """
import sys
from berth_runtime.models.model_files import read_model_files
from tests.helpers import embedded_model_dir
files = read_model_files(embedded_model_dir())
assert "torch" not in sys.modules or sys.modules["torch"] is None
import torch  # hidden only while the files were read
print("config:", type(files.config).__name__, files.config.num_hidden_layers)
ids = files.tokenizer.backend_tokenizer.encode("Paris").ids
print("eos:", sorted(files.eos_token_ids), "round trip:", files.tokenizer.decode(ids))
print("tokenizer:", type(files.tokenizer).__name__)
print("imported:", [m for m in ("sympy", "torch.distributed.tensor") if m in sys.modules])
"""


def run_python(code: str) -> str:
    paths = [str(REPO / p) for p in ("runtime", "common", "router", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_cpu_defaults_load_and_prefill_without_the_compiler_stack():
    assert "imported: []" in run_python(LOAD_AND_REPORT)


def test_config_and_tokenizer_read_before_torch_leave_out_transformers_torch_parts():
    out = run_python(READ_FILES_THEN_TORCH)
    assert "config: LlamaConfig 30" in out
    assert "eos: [2] round trip: Paris" in out
    assert "tokenizer: TokenizerJson" in out  # decoding needs no transformers tokenizer
    assert "imported: []" in out
