"""Benchmark metrics: per-request timings in, throughput and latency percentiles out.

Definitions (as in `sglang.bench_serving`):

* TTFT: request sent -> first stream chunk with generated text.
* ITL: the gaps between consecutive stream chunks that carry text (one chunk may hold several
  tokens, so ITL is per chunk, as a client sees it).
* TPOT: (end-to-end latency - TTFT) / (output tokens - 1), per request with more than one token.
* Decode tokens/s of a request: 1 / TPOT (its own stream's decode rate).
* Throughputs divide totals over successful requests by the benchmark's wall-clock duration.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES: tuple[int, ...] = (50, 90, 99)


@dataclass
class RequestResult:
    """What one request did, measured by the client."""

    success: bool = False
    prompt_len: int = 0  # tokens the client built
    output_len: int = 0  # tokens asked for
    output_tokens: int = 0  # tokens generated (the server's usage, else counted)
    server_prompt_tokens: int | None = None  # usage.prompt_tokens, when reported
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    start: float = 0.0  # perf_counter when sent
    ttft: float = 0.0
    latency: float = 0.0  # end-to-end
    chunk_times: list[float] = field(default_factory=list)  # seconds after start, text chunks
    generated_text: str = ""
    error: str = ""

    @property
    def itl(self) -> list[float]:
        return inter_token_latencies(self.chunk_times)

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_dict(self, with_text: bool = False) -> dict[str, Any]:
        data = asdict(self)
        if not with_text:
            data.pop("generated_text")
        data["itl"] = self.itl
        data["tpot"] = self.tpot
        return data


def inter_token_latencies(chunk_times: Sequence[float]) -> list[float]:
    """Gaps between consecutive chunk timestamps."""
    return [b - a for a, b in zip(chunk_times, chunk_times[1:])]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean, std, min, p50/p90/p99 and max of `values` times `scale` (NaN when empty)."""
    if not values:
        nan = math.nan
        return {"mean": nan, "std": nan, "min": nan, "p50": nan, "p90": nan, "p99": nan, "max": nan}
    scaled = [v * scale for v in values]
    mean = sum(scaled) / len(scaled)
    var = sum((v - mean) ** 2 for v in scaled) / len(scaled)
    out = {"mean": mean, "std": math.sqrt(var), "min": min(scaled)}
    out.update({f"p{q}": percentile(scaled, q) for q in PERCENTILES})
    out["max"] = max(scaled)
    return out


def summarize(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """The benchmark's headline numbers; latencies in milliseconds."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    itls = [gap for r in ok for gap in r.itl]
    decode_rates = [1.0 / t for t in tpots if t > 0]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    per_second = (lambda n: n / duration) if duration > 0 else (lambda n: math.nan)
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            key = r.error.splitlines()[0][:200] if r.error else "unknown error"
            errors[key] = errors.get(key, 0) + 1
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_cached_tokens": sum(cached) if cached else None,
        "request_throughput": per_second(len(ok)),
        "input_throughput": per_second(input_tokens),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
        "ttft_ms": distribution([r.ttft for r in ok], 1000),
        "tpot_ms": distribution(tpots, 1000),
        "itl_ms": distribution(itls, 1000),
        "e2e_latency_ms": distribution([r.latency for r in ok], 1000),
        "decode_tok_s": distribution(decode_rates),
    }


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def format_summary(summary: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """A fixed-width report like sglang.bench_serving's."""
    width = 56
    lines = [f" {title} ".center(width, "=")]

    def row(label: str, value: Any, digits: int = 2) -> None:
        text = _fmt(value, digits)
        lines.append(label + text.rjust(max(width - len(label), len(text) + 1)))

    for key, label in (("backend", "Backend:"), ("model", "Model:"), ("workload", "Workload:")):
        if key in summary:
            row(label, summary[key])
    if "concurrency" in summary:
        row("Max concurrency:", summary["concurrency"] or "unbounded")
    if "request_rate" in summary:
        row("Request rate (req/s):", summary["request_rate"])
    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    if summary.get("total_cached_tokens") is not None:
        row("Total cached prompt tokens:", summary["total_cached_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    row("Input token throughput (tok/s):", summary["input_throughput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    for key, name in (
        ("e2e_latency_ms", "End-to-End Latency"),
        ("ttft_ms", "Time to First Token"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)"),
        ("itl_ms", "Inter-Token Latency"),
    ):
        lines.append(f" {name} ".center(width, "-"))
        dist = summary[key]
        unit = "(ms)"
        for stat in ("mean", "p50", "p90", "p99"):
            row(f"{stat.capitalize() if stat == 'mean' else stat.upper()} {unit}:", dist[stat])
    lines.append(" Decode rate per stream ".center(width, "-"))
    row("Mean decode (tok/s):", summary["decode_tok_s"]["mean"])
    memory = summary.get("server_memory")
    if memory:
        lines.append(" Server memory ".center(width, "-"))
        row("Processes:", memory.get("processes"))
        row("Peak RSS, all processes (MiB):", memory.get("peak_rss_mib"), 1)
        row("RSS at end, all processes (MiB):", memory.get("rss_mib"), 1)
        if memory.get("pss_mib") is not None:
            row("PSS at end, all processes (MiB):", memory.get("pss_mib"), 1)
        for proc in memory.get("by_process") or []:
            row(f"  RSS {proc['title'][:30]} (MiB):", proc["rss_mib"], 1)
    for error, count in summary.get("errors", {}).items():
        lines.append(f"error x{count}: {error}")
    lines.append("=" * width)
    return "\n".join(lines)
