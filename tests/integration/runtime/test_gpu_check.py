"""`make gpu-check`'s script (hack/gpu-check/run.sh), run small on the CPU: every part runs and
its report holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_quick_cpu_run_reports_tests_parity_and_throughput(tmp_path):
    out = tmp_path / "gpu-check.json"
    proc = subprocess.run(
        ["hack/gpu-check/run.sh", "--quick", "--device", "cpu", "--out", str(out)],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHON": sys.executable, "WHEELS": str(tmp_path / "no-wheels")},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["passed"] is True

    # Part 1 found the gpu-marked tests and, with no GPU here, skipped each one.
    tests = report["tests"]
    assert "tests/integration/runtime/test_gpu_parity.py" in tests["files"]
    assert tests["counts"].get("skipped", 0) >= 2 and not tests["counts"].get("failed")

    # Part 2 on CPU is fp32 against HF fp32: the same three answers, the README's first.
    parity = report["parity"]
    assert parity["dtype"] == "float32"
    assert [p["equal"] for p in parity["prompts"]] == [True, True, True]
    assert parity["prompts"][0]["berth"] == "The capital of France is Paris."

    # Part 2b on CPU: two processes (gloo) sharing the cores, fp32: the same answers.
    tp = report["tensor_parallel"]
    assert tp["dtype"] == "float32" and tp["equal"] == tp["prompts"] == 3
    assert tp["ms_per_token"]["tp1"] > 0 and tp["ms_per_token"]["tp2"] > 0
    assert "answers on --tp-size 2 equal to one process's" in proc.stdout

    # Part 3: both models, both concurrencies, every request answered with tokens.
    assert [m["model"] for m in report["bench"]] == ["embedded", "dummy-1b"]
    for model in report["bench"]:
        assert model["ready_s"] > 0
        assert [r["concurrency"] for r in model["rows"]] == [1, 4]
        for row in model["rows"]:
            assert row["completed"] == row["requests"] and row["failed"] == 0
            assert row["output_tok_s"] > 0

    # The table on stdout carries the same figures.
    assert "parity with HF (float32, up to 48 tokens): 3/3 answers equal" in proc.stdout
    assert proc.stdout.rstrip().endswith("PASSED")
