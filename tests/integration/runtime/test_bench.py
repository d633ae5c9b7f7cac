"""`berth bench` for real against a real `berth serve`: a complete, consistent JSON result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from berth_runtime.bench.cli import main as bench_main
from tests.helpers import RunningServer


@pytest.mark.timeout(120)
def test_bench_against_a_real_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    num_prompts, output_len = 6, 4
    out = tmp_path / "result.json"
    server = RunningServer("--dtype", "float32").wait_ready()
    try:
        code = bench_main(
            [
                *("--base-url", server.base_url, "--server-pid", str(server.proc.pid)),
                *("--workload", "random", "--input-len", "40:60", "--output-len", str(output_len)),
                *("--num-prompts", str(num_prompts), "--concurrency", "3", "--seed", "1"),
                *("--output-file", str(out), "--disable-tqdm"),
            ]
        )
    finally:
        server.stop()
    assert code == 0
    printed = capsys.readouterr().out
    assert "Successful requests:" in printed and "Peak RSS" in printed

    result = json.loads(out.read_text())
    assert result["model"] == "smollm2-135m-instruct"
    assert result["completed"] == num_prompts and result["failed"] == 0
    assert result["total_output_tokens"] == num_prompts * output_len
    # The client's exact prompt lengths are what the server counted.
    assert result["prompt_tokens_mismatched"] == 0
    requests = result["requests"]
    assert len(requests) == num_prompts
    assert result["total_input_tokens"] == sum(r["prompt_len"] for r in requests)
    assert all(40 <= r["prompt_len"] <= 60 for r in requests)
    for r in requests:
        assert r["success"] and r["output_tokens"] == output_len
        assert r["server_prompt_tokens"] == r["prompt_len"]
        assert 0 < r["ttft"] <= r["latency"]
        assert r["chunk_times"] == sorted(r["chunk_times"]) and r["chunk_times"][0] == r["ttft"]
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms"):
        dist = result[key]
        assert 0 <= dist["min"] <= dist["p50"] <= dist["p90"] <= dist["p99"] <= dist["max"], key
    assert result["e2e_latency_ms"]["p50"] >= result["ttft_ms"]["p50"]
    assert result["output_throughput"] > 0 and result["request_throughput"] > 0
    assert abs(result["output_throughput"] * result["duration_s"] - num_prompts * output_len) < 1e-6
    memory = result["server_memory"]
    assert memory["processes"] >= 3  # api, scheduler, detokenizer
    assert memory["peak_rss_mib"] >= memory["rss_mib"] > 100
