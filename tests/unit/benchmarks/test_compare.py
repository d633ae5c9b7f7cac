"""The comparison report: ratios against the right baselines, targets judged, tables rendered."""

from __future__ import annotations

from dataclasses import asdict

from benchmarks.compare import CompareConfig, failed_berth_runs
from benchmarks.report import render, summarize_targets, target_rows
from benchmarks.systems import differing_answers, prefix_ttfts
from berth_runtime.bench.metrics import RequestResult, summarize


def fake_result(label: str, n: int, out: int, ttft: float, step: float, duration: float) -> dict:
    results = [
        RequestResult(
            success=True,
            prompt_len=48,
            output_len=out,
            output_tokens=out,
            ttft=ttft,
            latency=ttft + step * (out - 1),
            chunk_times=[ttft + step * k for k in range(out)],
        )
        for _ in range(n)
    ]
    return {
        "backend": label,
        **summarize(results, duration),
        "requests": [r.to_dict() for r in results],
    }


def prefix_run(first: float, second: float) -> dict:
    a = fake_result("p", 1, 4, first, 0.01, 1)["requests"][0]
    b = fake_result("p", 1, 4, second, 0.01, 1)["requests"][0]
    b["cached_tokens"] = 2000
    return {"requests": [a, b]}


def fake_report() -> dict:
    cfg = CompareConfig()
    prefix = [prefix_run(1.0, 0.1)]
    return {
        "config": asdict(cfg),
        "machine": {"cpus": 2, "platform": "test", "torch_threads": 2},
        "scenarios": [
            {"name": "single", "title": "single stream (3x128)"},
            {"name": "c8", "title": "8 concurrent (8x128)"},
            {"name": "c32", "title": "32 concurrent (32x128)"},
            {"name": "prefix", "title": "shared 2000-token prefix"},
        ],
        "berth": {
            "auto": {
                "scenarios": {
                    # 3 x 128 tokens in 6 s; 20 ms TPOT -> 50 tok/s decode; TTFT 50 ms.
                    "single": fake_result("b", 3, 128, 0.05, 0.02, 6.0),
                    "c8": fake_result("b", 8, 128, 0.2, 0.05, 1024 / 260),
                    "c32": fake_result("b", 32, 128, 0.5, 0.2, 4096 / 400),
                    "prefix": {"runs": prefix, **prefix_ttfts(prefix)},
                },
                "memory": {"peak_rss_mib": 1500.0, "pss_mib": 1200.0},
                "idle_memory_mib": {"processes": 3, "rss_mib": 1400.0, "pss_mib": 1100.0},
            }
        },
        "hf": {
            "fp32": {
                "scenarios": {
                    "single": fake_result("HF generate() fp32 sequential", 3, 128, 0.08, 1 / 32, 12)
                }
            },
            "bf16": {
                "scenarios": {
                    "c8": fake_result("HF generate() bf16 static batch 8", 8, 128, 0.1, 0.04, 5.12),
                    "c32": fake_result(
                        "HF generate() bf16 static batch 32", 32, 128, 0.3, 0.07, 9.2
                    ),
                }
            },
        },
        "notes": ["llama.cpp server not installed: not measured"],
    }


def test_prefix_ttfts_ratio():
    out = prefix_ttfts([prefix_run(1.0, 0.1), prefix_run(2.0, 0.3)])
    assert out["first_ttft_ms"] == 1500 and out["second_ttft_ms"] == 200
    assert abs(out["ratio"] - 200 / 1500) < 1e-9
    assert out["cached_tokens_second"] == [2000, 2000]


def test_targets_use_the_issue_baselines():
    report = fake_report()
    rows = {row["target"].split(":")[0]: row for row in target_rows(report)}
    c32 = rows["32 concurrent"]
    assert abs(c32["berth"] - 400) < 1e-6 and abs(c32["baseline"] - 4096 / 9.2) < 1e-6
    assert abs(c32["ratio"] - 400 / (4096 / 9.2)) < 1e-9 and c32["met"] is False
    c8 = rows["8 concurrent"]
    assert abs(c8["ratio"] - 260 / 200) < 1e-9 and c8["met"] is True
    decode = next(r for r in target_rows(report) if "decode" in r["target"])
    assert abs(decode["ratio"] - 50 / 32) < 1e-6 and decode["met"] is True
    ttft = next(r for r in target_rows(report) if "TTFT p50" in r["target"])
    assert abs(ttft["berth"] - 50) < 1e-6 and ttft["met"] is True and ttft["ratio"] is None
    prefix = next(r for r in target_rows(report) if "prefix" in r["target"])
    assert abs(prefix["ratio"] - 0.1) < 1e-9 and prefix["met"] is True
    memory = next(r for r in target_rows(report) if "memory" in r["target"])
    assert memory["berth"] == 1500.0 and memory["met"] is True


def test_missing_baseline_gives_no_ratio():
    report = fake_report()
    del report["hf"]
    rows = target_rows(report)
    c32 = next(r for r in rows if r["target"].startswith("32 concurrent"))
    assert c32["ratio"] is None and c32["met"] is None


def test_render_prints_every_system_and_target():
    report = fake_report()
    report["targets"] = target_rows(report)
    text = render(report)
    for needle in (
        "Berth (auto)",
        "HF generate() fp32 sequential",
        "HF generate() bf16 static batch 32",
        "32 concurrent (32x128)",
        "2nd/1st",
        "0.100x",
        "Targets (issue 3",
        ">= 1.3x",
        "NO",
        "peak RSS 1,500.0 MiB",
        "llama.cpp server not installed",
    ):
        assert needle in text, needle


def scaled_round(report: dict, berth_c32_tok_s: float, peak_rss: float, order: list) -> dict:
    """A copy of the fake report's systems with Berth's c32 throughput and peak RSS changed."""
    import copy

    one = {key: copy.deepcopy(report[key]) for key in ("berth", "hf")}
    c32 = one["berth"]["auto"]["scenarios"]["c32"]
    c32["output_throughput"] = berth_c32_tok_s
    one["berth"]["auto"]["memory"]["peak_rss_mib"] = peak_rss
    one["order"] = order
    return one


def test_rounds_are_judged_on_the_median_and_memory_on_the_highest_peak():
    report = fake_report()
    baseline = 4096 / 9.2
    rounds = [
        scaled_round(report, 1.2 * baseline, 1500.0, ["Berth", "HF"]),
        scaled_round(report, 1.5 * baseline, 2100.0, ["HF", "Berth"]),
        scaled_round(report, 1.4 * baseline, 1600.0, ["Berth", "HF"]),
    ]
    per_round = [target_rows({**report, **one}) for one in rounds]
    summary = {row["target"].split(":")[0]: row for row in summarize_targets(per_round)}
    c32 = summary["32 concurrent"]
    assert abs(c32["ratio"] - 1.4) < 1e-9 and c32["met"] is True  # the first round alone: NO
    assert [round(r, 6) for r in c32["rounds"]] == [1.2, 1.5, 1.4]
    memory = summary["memory"]
    assert memory["berth"] == 2100.0 and memory["met"] is False  # one round over the limit
    assert memory["rounds"] == [1500.0, 2100.0, 1600.0]
    ttft = summary["single stream"]  # by value, not by ratio
    assert ttft["ratio"] is None and abs(ttft["berth"] - 50) < 1e-6 and ttft["met"] is True

    report["rounds"] = [{**one, "targets": rows} for one, rows in zip(rounds, per_round)]
    report["targets"] = summarize_targets(per_round)
    del report["berth"], report["hf"]
    text = render(report)
    for needle in (
        "Round 1 of 3: Berth -> HF",
        "Round 2 of 3: HF -> Berth",
        "medians over 3 rounds",
        "1.20x / 1.50x / 1.40x",
        "1,500 / 2,100 / 1,600",
        "Memory (round 3)",
    ):
        assert needle in text, needle


def test_a_failed_berth_server_in_any_round_fails_the_run():
    report = fake_report()
    ok = {"berth": report["berth"]}
    broken = {"berth": {"auto": {"error": "exited"}}}
    assert failed_berth_runs({"rounds": [ok, ok]}) == []
    assert failed_berth_runs({"rounds": [ok, broken]}) == ["auto"]


def with_texts(result: dict, texts: list[str]) -> dict:
    for request, text in zip(result["requests"], texts):
        request["generated_text"] = text
    return result


def with_llama_and_modes(report: dict, ngram_texts: list[str], solo_differ: int) -> dict:
    """The fake report plus llama-server's figures, the rewrite and deterministic scenarios, and
    the ngram and deterministic servers."""
    report["llama_cpp"] = {
        "kind": "llama-server",
        "scenarios": {
            "single": fake_result("llama-server", 3, 128, 0.1, 1 / 40, 10),  # 40 tok/s, 100 ms
            "c8": fake_result("llama-server", 8, 128, 1.0, 0.2, 1024 / 100),
            "c32": fake_result("llama-server", 32, 128, 4.0, 0.5, 4096 / 100),
        },
    }
    berth = report["berth"]["auto"]["scenarios"]
    berth["rewrite"] = with_texts(fake_result("b", 3, 300, 0.1, 1 / 50, 20), ["a", "b", "c"])
    berth["deterministic"] = {
        **fake_result("b", 16, 128, 0.3, 0.1, 2048 / 300),
        "differ_from_solo": 0,
    }
    report["berth"]["auto ngram"] = {
        "dtype": "auto",
        "variant": "ngram",
        "scenarios": {
            "rewrite": with_texts(fake_result("s", 3, 300, 0.1, 1 / 120, 8), ngram_texts)
        },
    }
    determined = {
        **fake_result("d", 16, 128, 0.3, 0.1, 2048 / 285),
        "differ_from_solo": solo_differ,
    }
    report["berth"]["auto deterministic"] = {
        "dtype": "auto",
        "variant": "deterministic",
        "scenarios": {"deterministic": determined},
    }
    return report


def test_issue_19_targets_against_llama_server_and_between_modes():
    report = with_llama_and_modes(fake_report(), ["a", "b", "c"], solo_differ=0)
    rows = {(row["system"], row["target"]): row for row in target_rows(report)}
    plain, ngram, det = "Berth (auto)", "Berth (auto, ngram)", "Berth (auto, deterministic)"
    single = rows[(plain, "single stream: decode tok/s vs llama-server")]
    assert abs(single["ratio"] - 50 / 40) < 1e-6 and single["met"] is True
    ttft = rows[(plain, "single stream: TTFT p50 vs llama-server")]
    assert abs(ttft["ratio"] - 0.5) < 1e-6 and ttft["met"] is True
    c8 = rows[(plain, "8 concurrent: output tok/s vs llama-server")]
    assert abs(c8["ratio"] - 2.6) < 1e-6 and c8["met"] is True
    c32 = rows[(plain, "32 concurrent: output tok/s vs llama-server")]
    assert abs(c32["ratio"] - 4.0) < 1e-6 and c32["met"] is True
    pss = rows[(plain, "memory: whole-server PSS MiB after the last scenario")]
    assert pss["berth"] == 1200.0 and pss["met"] is False  # over 1 GiB
    rewrite = rows[
        (ngram, "rewrite, single stream: decode tok/s with ngram speculation vs without")
    ]
    assert abs(rewrite["ratio"] - 120 / 50) < 1e-6 and rewrite["met"] is True
    assert rows[(ngram, "rewrite: answers that differ from plain decoding's")]["berth"] == 0
    cost = rows[(det, "16 concurrent: output tok/s, deterministic mode vs defaults (its cost)")]
    assert abs(cost["ratio"] - 0.95) < 1e-6 and cost["met"] is True
    for server in (det, plain):
        solo = rows[(server, "16 concurrent: answers that differ from one at a time")]
        assert solo["berth"] == 0 and solo["met"] is True
    report["targets"] = target_rows(report)
    text = render(report)
    for needle in (
        "Berth (auto, ngram)",
        "Berth (auto, deterministic)",
        "<= 1024 MiB",
        "<= 0 answers",
    ):
        assert needle in text, needle


def test_a_changed_answer_fails_in_any_round():
    good = with_llama_and_modes(fake_report(), ["a", "b", "c"], solo_differ=0)
    bad = with_llama_and_modes(fake_report(), ["a", "b", "x"], solo_differ=2)
    summary = summarize_targets([target_rows(good), target_rows(bad), target_rows(good)])
    by_target = {(row["system"], row["target"]): row for row in summary}
    spec = by_target[("Berth (auto, ngram)", "rewrite: answers that differ from plain decoding's")]
    assert spec["berth"] == 1 and spec["met"] is False and spec["rounds"] == [0, 1, 0]
    solo = by_target[
        ("Berth (auto, deterministic)", "16 concurrent: answers that differ from one at a time")
    ]
    assert solo["berth"] == 2 and solo["met"] is False


def test_differing_answers_counts_failures_and_needs_texts():
    a = with_texts(fake_result("a", 3, 4, 0.1, 0.01, 1), ["x", "y", "z"])
    b = with_texts(fake_result("b", 3, 4, 0.1, 0.01, 1), ["x", "y", "w"])
    assert differing_answers(a, a) == 0 and differing_answers(a, b) == 1
    b["requests"][0]["success"] = False
    assert differing_answers(a, b) == 2
    assert differing_answers(a, fake_result("c", 3, 4, 0.1, 0.01, 1)) is None
