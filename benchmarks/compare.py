"""Side-by-side comparison in one run: Berth (launched here) vs HF `generate()` on the same prompts.

    make bench                               # quick: two rounds, about five minutes on 2 cores
    python -m benchmarks.compare --full      # three rounds, more prompts, both baseline dtypes

Scenarios follow the targets of issue 3 (48-token chat prompts, 128 output tokens, greedy):

* `single`: one stream at a time; Berth vs HF `generate()` sequential (fp32).
* `c8` / `c32`: 8 / 32 concurrent requests; Berth (closed loop) vs one HF static batch (bf16).
* `prefix`: a 2,000-token shared system prefix, two requests one after the other on a flushed
  cache; the second request's TTFT over the first's.
* `rewrite`: single stream, three ~300-token code snippets to be repeated with one change each
  (`benchmarks/speculative.py`), answered to the end (no `ignore_eos`); Berth with and without
  `--speculative-algorithm ngram`, whose answers must be the same.
* `deterministic`: 16 concurrent chat requests; Berth with `--enable-deterministic-inference` and
  at its defaults, each server's concurrent answers checked against the same prompts sent one at
  a time: the mode's cost, and whether a request's answer depends on its batch.
* memory: the Berth server's RSS summed over all its processes (peak while benchmarking), and its
  PSS after the last scenario.

llama.cpp's server is measured too when `llama-server` or `llama_cpp.server` is installed, and
the targets of issue 19 (ratios to it) are judged beside those of issue 3 (ratios to HF).

A shared machine's speed drifts over minutes (other tenants' memory traffic), so the whole
comparison runs in rounds that alternate the order of the systems (Berth first, then the baseline
first, ...): a drift that favours whichever runs first cancels out, and each target is judged on
the median over the rounds, with every round's value shown beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.report import render, summarize_targets, target_rows
from benchmarks.speculative import workloads as speculative_prompts
from benchmarks.systems import log, run_berth, run_hf, run_llama_cpp
from berth_runtime.bench.cli import positive
from berth_runtime.bench.workload import (
    BenchRequest,
    chat_ids,
    chat_workload,
    load_tokenizer,
    shared_prefix_workload,
)
from berth_runtime.utils import cpu_isa

SCENARIOS: tuple[str, ...] = ("single", "c8", "c32", "prefix", "rewrite", "deterministic")
# The scenarios HF generate() has a baseline for, and those llama.cpp's server runs.
HF_SCENARIOS = ("single", "c8", "c32", "prefix")
LLAMA_CPP_SCENARIOS = ("single", "c8", "c32", "prefix", "rewrite")
# Berth servers beside the one at its defaults: their flags, and the scenarios each runs.
BERTH_VARIANTS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "ngram": (["--speculative-algorithm", "ngram"], ("rewrite",)),
    "deterministic": (["--enable-deterministic-inference"], ("deterministic",)),
}


@dataclass
class CompareConfig:
    """What to measure; the defaults are the quick run (a few minutes on 2 cores)."""

    scenarios: list[str] = field(default_factory=lambda: list(SCENARIOS))
    input_len: int = 48
    output_len: int = 128
    num_single: int = 3
    num_c8: int = 8
    num_c32: int = 32
    prefix_len: int = 2000
    prefix_question_len: int = 32
    prefix_output_len: int = 16
    prefix_groups: int = 1
    num_deterministic: int = 16
    rewrite_output_len: int = 400
    berth_dtypes: list[str] = field(default_factory=lambda: ["auto"])
    server_args: list[str] = field(default_factory=list)
    hf_single_dtypes: list[str] = field(default_factory=lambda: ["fp32"])
    hf_batch_dtypes: list[str] = field(default_factory=lambda: ["bf16"])
    run_berth: bool = True
    run_hf: bool = True
    run_llama_cpp: bool = True
    seed: int = 0
    disable_tqdm: bool = False
    rounds: int = 2

    @classmethod
    def full(cls) -> CompareConfig:
        """The full run: more prompts per scenario, both dtypes for the baseline."""
        return cls(
            rounds=3,
            num_single=10,
            num_c8=32,
            num_c32=128,
            prefix_groups=3,
            hf_single_dtypes=["fp32", "bf16"],
            hf_batch_dtypes=["bf16", "fp32"],
        )


@dataclass
class Scenario:
    name: str
    title: str
    concurrency: int
    requests: list[BenchRequest]
    ignore_eos: bool = True  # False: answered to the end, as a user would read it


def build_scenarios(cfg: CompareConfig, tokenizer: Any) -> list[Scenario]:
    """The prompts of every scenario, identical for every system (a distinct seed each, so no
    scenario finds another's prompts in a prefix cache)."""
    lengths = ((cfg.input_len, cfg.input_len), (cfg.output_len, cfg.output_len))
    out: list[Scenario] = []
    for index, name in enumerate(SCENARIOS):
        if name not in cfg.scenarios:
            continue
        seed = cfg.seed * 100 + index
        if name == "prefix":
            requests = shared_prefix_workload(
                tokenizer,
                cfg.prefix_groups,
                2,
                cfg.prefix_len,
                cfg.prefix_question_len,
                (cfg.prefix_output_len, cfg.prefix_output_len),
                "chat",
                seed,
            )
            title = f"shared {cfg.prefix_len}-token prefix"
            out.append(Scenario(name, title, 1, requests))
            continue
        if name == "rewrite":
            requests = rewrite_workload(tokenizer, cfg.rewrite_output_len)
            title = f"rewrite, single stream ({len(requests)}x<={cfg.rewrite_output_len})"
            out.append(Scenario(name, title, 1, requests, ignore_eos=False))
            continue
        concurrency, count = {
            "single": (1, cfg.num_single),
            "c8": (8, cfg.num_c8),
            "c32": (32, cfg.num_c32),
            "deterministic": (cfg.num_deterministic, cfg.num_deterministic),
        }[name]
        requests = chat_workload(tokenizer, count, *lengths, seed=seed)
        title = "single stream" if concurrency == 1 else f"{concurrency} concurrent"
        if name == "deterministic":
            title += ", against one at a time"
        out.append(Scenario(name, f"{title} ({count}x{cfg.output_len})", concurrency, requests))
    return out


def rewrite_workload(tokenizer: Any, output_len: int) -> list[BenchRequest]:
    """`benchmarks.speculative`'s rewrite requests: a snippet to repeat with one change."""
    requests = []
    for prompt in speculative_prompts()["rewrite"]:
        messages = [{"role": "user", "content": prompt}]
        ids = chat_ids(tokenizer, messages)
        requests.append(BenchRequest(prompt, ids, output_len, messages=messages))
    return requests


def run_round(
    cfg: CompareConfig, scenarios: list[Scenario], tokenizer: Any, baseline_first: bool
) -> dict[str, Any]:
    """Every configured system once, in this round's order; {system: results, "order": [...]}."""
    runners: list[tuple[str, str, Callable[[], Any]]] = []
    if cfg.run_berth:
        runners.append(
            ("berth", "Berth", lambda: run_berth(cfg, scenarios, tokenizer, BERTH_VARIANTS))
        )
    for_llama = [s for s in scenarios if s.name in LLAMA_CPP_SCENARIOS]
    if cfg.run_llama_cpp and for_llama:
        runners.append(("llama_cpp", "llama.cpp", lambda: run_llama_cpp(cfg, for_llama, tokenizer)))
    for_hf = [s for s in scenarios if s.name in HF_SCENARIOS]
    if cfg.run_hf and for_hf:
        runners.append(("hf", "HF", lambda: run_hf(cfg, for_hf)))
    if baseline_first:
        runners.reverse()
    one: dict[str, Any] = {"order": [label for _, label, _ in runners]}
    for key, _, run in runners:
        one[key] = run()
    return one


def compare(cfg: CompareConfig) -> dict[str, Any]:
    """Measure everything configured, in `cfg.rounds` rounds; the report dict (render() prints
    it): `rounds` holds each round's results, `targets` the medians over them."""
    import torch

    started = time.time()
    tokenizer = load_tokenizer()
    scenarios = build_scenarios(cfg, tokenizer)
    report: dict[str, Any] = {
        "config": asdict(cfg),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "scenarios": [
            {
                "name": s.name,
                "title": s.title,
                "concurrency": s.concurrency,
                "num_prompts": len(s.requests),
                "prompt_len": s.requests[0].prompt_len,
                "output_len": s.requests[0].output_len,
            }
            for s in scenarios
        ],
        "notes": [],
    }
    rounds = []
    for index in range(max(1, cfg.rounds)):
        log(f"round {index + 1} of {cfg.rounds}")
        one = run_round(cfg, scenarios, tokenizer, baseline_first=index % 2 == 1)
        one["targets"] = target_rows({**report, **one})
        rounds.append(one)
    report["rounds"] = rounds
    if cfg.run_llama_cpp and all(one.get("llama_cpp") is None for one in rounds):
        report["notes"].append("llama.cpp server not installed: not measured")
    if cpu_isa.isa_cap() is not None:
        report["notes"].append(
            f"CPU capped to {cpu_isa.isa_cap()} ({cpu_isa.ISA_ENV}): Berth's kernels, PyTorch, "
            "oneDNN and MKL, and the llama-server build (LLAMA_ISA), run that code only"
        )
    report["targets"] = summarize_targets([one["targets"] for one in rounds])
    report["duration_s"] = time.time() - started
    return report


def failed_berth_runs(report: dict[str, Any]) -> list[str]:
    """The Berth dtypes whose server failed in any round."""
    rounds = report.get("rounds") or [report]
    return sorted(
        {d for one in rounds for d, r in (one.get("berth") or {}).items() if "error" in r}
    )


def write_report(report: dict[str, Any], path: str) -> None:
    """The report as JSON, per-request timings included."""
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
        f.write("\n")


# --- command line ------------------------------------------------------------------------------


COMPARE_EPILOG = """\
The quick default (two rounds, Berth first then the baseline first) finishes in about five
minutes on 2 cores; --full runs three rounds, more prompts per scenario and both dtypes for the
baseline. `make bench BENCH_ARGS="--full"` does the same.
"""


def _csv(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.compare",
        description="Launch `berth serve`, measure it, then HF transformers generate() on the "
        "same prompts in this process (and llama.cpp's server if installed); print the ratios.",
        epilog=COMPARE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--full", action="store_true", help="the full run (more prompts, both dtypes)")
    p.add_argument(
        "--scenarios",
        type=_csv,
        default=list(SCENARIOS),
        help=f"comma list of {','.join(SCENARIOS)} (default: all)",
    )
    p.add_argument(
        "--berth-dtype",
        type=_csv,
        default=["auto"],
        help="Berth's --dtype; a comma list measures one server per dtype (default auto)",
    )
    p.add_argument("--server-args", default="", help="more flags for `berth serve`")
    p.add_argument("--hf-single-dtypes", type=_csv, help="HF sequential dtypes (quick: fp32)")
    p.add_argument("--hf-batch-dtypes", type=_csv, help="HF static batch dtypes (quick: bf16)")
    p.add_argument("--num-single", type=positive, help="prompts, single stream (quick 3)")
    p.add_argument("--num-c8", type=positive, help="prompts at 8 concurrent (quick 8)")
    p.add_argument("--num-c32", type=positive, help="prompts at 32 concurrent (quick 32)")
    p.add_argument("--input-len", type=positive, help="chat prompt tokens (48)")
    p.add_argument("--output-len", type=positive, help="output tokens (128)")
    p.add_argument("--prefix-len", type=positive, help="shared prefix tokens (2000)")
    p.add_argument("--prefix-groups", type=positive, help="shared-prefix pairs (quick 1)")
    p.add_argument(
        "--rounds",
        type=positive,
        help="measure everything this many times, alternating which system goes first; "
        "targets are judged on the medians (quick 2, full 3)",
    )
    p.add_argument("--skip-berth", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-llama-cpp", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-file", help="write the whole report as JSON here")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        build_parser().error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    cfg = CompareConfig.full() if args.full else CompareConfig()
    cfg.scenarios = args.scenarios
    cfg.berth_dtypes = args.berth_dtype
    cfg.server_args = shlex.split(args.server_args)
    overrides = {
        "hf_single_dtypes": args.hf_single_dtypes,
        "hf_batch_dtypes": args.hf_batch_dtypes,
        "num_single": args.num_single,
        "num_c8": args.num_c8,
        "num_c32": args.num_c32,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prefix_len": args.prefix_len,
        "prefix_groups": args.prefix_groups,
        "rounds": args.rounds,
    }
    for key, value in overrides.items():
        if value is not None:
            setattr(cfg, key, value)
    cfg.run_berth = not args.skip_berth
    cfg.run_hf = not args.skip_hf
    cfg.run_llama_cpp = not args.skip_llama_cpp
    cfg.seed = args.seed
    cfg.disable_tqdm = args.disable_tqdm
    report = compare(cfg)
    print(render(report))
    if args.output_file:
        write_report(report, args.output_file)
        print(f"[bench] wrote {args.output_file}", file=sys.stderr)
    return 1 if failed_berth_runs(report) else 0


if __name__ == "__main__":
    sys.exit(main())
