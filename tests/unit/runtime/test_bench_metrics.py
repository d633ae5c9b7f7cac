"""Benchmark metrics: percentiles, ITL/TPOT from synthetic timestamps, summaries, arrivals."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from berth_runtime.bench.client import poisson_arrivals
from berth_runtime.bench.metrics import (
    RequestResult,
    distribution,
    format_summary,
    inter_token_latencies,
    percentile,
    summarize,
)


def test_percentile_matches_numpy():
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 101):
        values = [rng.uniform(0, 100) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_is_ordered_and_scaled():
    dist = distribution([0.1, 0.2, 0.3, 0.4, 1.0], scale=1000)
    assert dist["min"] == pytest.approx(100) and dist["max"] == pytest.approx(1000)
    assert dist["mean"] == pytest.approx(400)
    assert dist["min"] <= dist["p50"] <= dist["p90"] <= dist["p99"] <= dist["max"]
    assert dist["p50"] == pytest.approx(300)
    assert all(math.isnan(v) for v in distribution([]).values())


def test_itl_and_tpot_from_synthetic_timestamps():
    # First chunk at 100 ms, then chunks 20, 30 and 50 ms apart; the stream ends at 250 ms.
    r = RequestResult(
        success=True,
        output_tokens=4,
        ttft=0.1,
        latency=0.25,
        chunk_times=[0.1, 0.12, 0.15, 0.2],
    )
    assert inter_token_latencies(r.chunk_times) == pytest.approx([0.02, 0.03, 0.05])
    assert r.itl == pytest.approx([0.02, 0.03, 0.05])
    assert r.tpot == pytest.approx((0.25 - 0.1) / 3)
    assert RequestResult(success=True, output_tokens=1, latency=1.0).tpot is None
    assert RequestResult(success=False, output_tokens=9, latency=1.0).tpot is None
    assert inter_token_latencies([0.5]) == []


def test_summary_counts_only_successes():
    ok = [
        RequestResult(
            success=True,
            prompt_len=10,
            output_len=5,
            output_tokens=5,
            ttft=0.1 * (i + 1),
            latency=0.1 * (i + 1) + 0.4,
            chunk_times=[0.1 * (i + 1) + 0.1 * k for k in range(5)],
            cached_tokens=i,
        )
        for i in range(4)
    ]
    bad = RequestResult(success=False, prompt_len=10, output_len=5, error="HTTP 503: full\nmore")
    summary = summarize([*ok, bad], duration=2.0)
    assert summary["num_requests"] == 5
    assert summary["completed"] == 4 and summary["failed"] == 1
    assert summary["errors"] == {"HTTP 503: full": 1}
    assert summary["total_input_tokens"] == 40
    assert summary["total_output_tokens"] == 20
    assert summary["total_cached_tokens"] == 0 + 1 + 2 + 3
    assert summary["request_throughput"] == pytest.approx(2.0)
    assert summary["output_throughput"] == pytest.approx(10.0)
    assert summary["input_throughput"] == pytest.approx(20.0)
    assert summary["total_token_throughput"] == pytest.approx(30.0)
    assert summary["ttft_ms"]["mean"] == pytest.approx(250)
    assert summary["ttft_ms"]["p50"] == pytest.approx(250)
    # Every request decodes 4 tokens in 0.4 s after its first: TPOT 100 ms, ITL 100 ms each.
    assert summary["tpot_ms"]["p50"] == pytest.approx(100)
    assert summary["itl_ms"]["p99"] == pytest.approx(100)
    assert summary["decode_tok_s"]["mean"] == pytest.approx(10)
    assert summary["e2e_latency_ms"]["max"] == pytest.approx(800)
    text = format_summary({**summary, "backend": "x", "concurrency": None})
    assert "Successful requests:" in text and "unbounded" in text and "HTTP 503: full" in text


def test_summary_with_no_successes_is_nan_not_an_error():
    summary = summarize([RequestResult(error="boom")], duration=1.0)
    assert summary["completed"] == 0
    assert math.isnan(summary["ttft_ms"]["p50"])
    format_summary(summary)


def test_poisson_arrivals_seeded():
    a = poisson_arrivals(2000, 4.0, seed=7)
    assert a == poisson_arrivals(2000, 4.0, seed=7)
    assert a != poisson_arrivals(2000, 4.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.25, rel=0.1)
    assert gaps.std() == pytest.approx(0.25, rel=0.15)  # exponential: std == mean
    assert poisson_arrivals(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    assert poisson_arrivals(0, 1.0, seed=0) == []
    with pytest.raises(ValueError):
        poisson_arrivals(2, 0.0, seed=0)
