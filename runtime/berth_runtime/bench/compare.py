"""Side-by-side comparison in one run: Berth (launched here) vs HF `generate()` on the same prompts.

Scenarios follow the targets of issue 3 (48-token chat prompts, 128 output tokens, greedy):

* `single`: one stream at a time; Berth vs HF `generate()` sequential (fp32).
* `c8` / `c32`: 8 / 32 concurrent requests; Berth (closed loop) vs one HF static batch (bf16).
* `prefix`: a 2,000-token shared system prefix, two requests one after the other on a flushed
  cache; the second request's TTFT over the first's.
* memory: the Berth server's RSS summed over all its processes (peak while benchmarking).

llama.cpp's server is measured too when `llama-server` or `llama_cpp.server` is installed.

A shared machine's speed drifts over minutes (other tenants' memory traffic), so the whole
comparison runs in rounds that alternate the order of the systems (Berth first, then the baseline
first, ...): a drift that favours whichever runs first cancels out, and each target is judged on
the median over the rounds, with every round's value shown beside it.
"""

from __future__ import annotations

import json
import math
import operator
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from berth_runtime.bench.client import BenchConfig, run_benchmark
from berth_runtime.bench.server import (
    LaunchedServer,
    find_llama_cpp,
    launch_berth,
    launch_llama_cpp,
    tree_memory,
)
from berth_runtime.bench.workload import (
    EMBEDDED_MODEL,
    BenchRequest,
    chat_workload,
    load_tokenizer,
    shared_prefix_workload,
)

SCENARIOS: tuple[str, ...] = ("single", "c8", "c32", "prefix")
MIB = 1024 * 1024


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


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


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
        concurrency, count = {
            "single": (1, cfg.num_single),
            "c8": (8, cfg.num_c8),
            "c32": (32, cfg.num_c32),
        }[name]
        requests = chat_workload(tokenizer, count, *lengths, seed=seed)
        title = "single stream" if concurrency == 1 else f"{concurrency} concurrent"
        out.append(Scenario(name, f"{title} ({count}x{cfg.output_len})", concurrency, requests))
    return out


def prefix_ttfts(results: list[dict[str, Any]]) -> dict[str, Any]:
    """First and second TTFT (ms) of each shared-prefix pair, averaged over the pairs."""
    firsts, seconds = [], []
    for result in results:
        requests = result["requests"]
        if len(requests) >= 2 and requests[0]["success"] and requests[1]["success"]:
            firsts.append(requests[0]["ttft"] * 1000)
            seconds.append(requests[1]["ttft"] * 1000)
    if not firsts:
        return {"first_ttft_ms": math.nan, "second_ttft_ms": math.nan, "ratio": math.nan}
    first = sum(firsts) / len(firsts)
    second = sum(seconds) / len(seconds)
    return {
        "first_ttft_ms": first,
        "second_ttft_ms": second,
        "ratio": second / first if first > 0 else math.nan,
        "pairs": len(firsts),
        "cached_tokens_second": [
            r["requests"][1].get("cached_tokens") for r in results if len(r["requests"]) >= 2
        ],
    }


def measure_server(
    name: str,
    server: LaunchedServer,
    scenarios: list[Scenario],
    cfg: CompareConfig,
    tokenizer: Any,
) -> dict[str, Any]:
    """Every scenario against one running server; peak memory over the whole session."""
    startup = server.wait_ready()
    idle = tree_memory(server.pid, with_pss=True)
    log(f"{name} ready in {startup:.1f}s (pid {server.pid})")
    try:
        info = httpx.get(f"{server.base_url}/get_server_info", timeout=10, trust_env=False)
        server_info = info.json() if info.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        server_info = None
    out: dict[str, Any] = {
        "server_info": server_info,
        "startup_s": startup,
        "idle_memory_mib": _mib(idle),
        "scenarios": {},
    }
    peak = idle["rss_bytes"] / MIB if idle else 0.0
    last_pss = None
    for scenario in scenarios:
        bench = BenchConfig(
            base_url=server.base_url,
            concurrency=scenario.concurrency,
            seed=cfg.seed,
            server_pid=server.pid,
            disable_tqdm=cfg.disable_tqdm,
            tokenizer=tokenizer,
            label=f"{name} {scenario.name}",
        )
        if scenario.name == "prefix":
            # One flushed-cache pair per group, no warm-up (it would cache the prefix).
            bench.warmup_requests = 0
            bench.flush_cache = True
            pairs = [scenario.requests[i : i + 2] for i in range(0, len(scenario.requests), 2)]
            runs = [run_benchmark(bench, pair) for pair in pairs]
            out["scenarios"]["prefix"] = {"runs": runs, **prefix_ttfts(runs)}
            memories = [r["server_memory"] for r in runs if r.get("server_memory")]
        else:
            log(f"{name}: {scenario.title}, concurrency {scenario.concurrency}")
            result = run_benchmark(bench, scenario.requests)
            out["scenarios"][scenario.name] = result
            memories = [result["server_memory"]] if result.get("server_memory") else []
            _log_result(name, scenario, result)
        for memory in memories:
            peak = max(peak, memory.get("peak_rss_mib") or 0.0)
            last_pss = memory.get("pss_mib") or last_pss
    out["memory"] = {"peak_rss_mib": peak, "pss_mib": last_pss}
    return out


def _mib(mem: dict[str, Any] | None) -> dict[str, Any] | None:
    if mem is None:
        return None
    pss = mem.get("pss_bytes")
    return {
        "processes": mem["processes"],
        "rss_mib": mem["rss_bytes"] / MIB,
        "pss_mib": pss / MIB if pss else None,
        "by_process": [
            {
                "pid": p["pid"],
                "title": p["title"],
                "rss_mib": p["rss"] / MIB,
                "pss_mib": p["pss"] / MIB,
            }
            for p in mem.get("by_process", [])
        ],
    }


def berth_name(dtype: str, result: dict[str, Any]) -> str:
    """ "Berth (float32)", or "Berth (auto: float32)" with the dtype the server chose."""
    chosen = _get(result, "server_info", "engine", "dtype")
    return f"Berth ({dtype}: {chosen})" if dtype == "auto" and chosen else f"Berth ({dtype})"


def _log_result(name: str, scenario: Scenario, result: dict[str, Any]) -> None:
    log(
        f"{name} {scenario.name}: {result['output_throughput']:.1f} out tok/s, "
        f"TTFT p50 {result['ttft_ms']['p50']:.0f} ms, "
        f"decode {result['decode_tok_s']['mean']:.1f} tok/s/stream, "
        f"{result['completed']}/{result['num_requests']} ok"
    )


def run_berth(cfg: CompareConfig, scenarios: list[Scenario], tokenizer: Any) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for dtype in cfg.berth_dtypes:
        args = ([] if dtype == "auto" else ["--dtype", dtype]) + cfg.server_args
        log(f"launching berth serve {' '.join(args)}".rstrip())
        server = launch_berth(args)
        try:
            result = measure_server(f"Berth {dtype}", server, scenarios, cfg, tokenizer)
            result["server_args"] = args
            results[dtype] = result
        except Exception as err:
            log(f"Berth {dtype} failed: {err}\n{server.log_tail(3000)}")
            results[dtype] = {"error": str(err), "server_args": args}
        finally:
            code = server.stop()
            log(f"berth serve stopped (exit code {code}); log: {server.log_path}")
    return results


def run_llama_cpp(
    cfg: CompareConfig, scenarios: list[Scenario], tokenizer: Any
) -> dict[str, Any] | None:
    found = find_llama_cpp()
    if found is None:
        log("llama.cpp: neither `llama-server` nor `llama_cpp.server` is installed; skipped")
        return None
    kind, prefix = found
    from berth_runtime.models.loader import builtin_gguf_path

    parallel = max((s.concurrency for s in scenarios), default=1)
    longest = max((r.prompt_len + r.output_len for s in scenarios for r in s.requests), default=1)
    server = launch_llama_cpp(kind, prefix, str(builtin_gguf_path()), parallel, longest + 64)
    log(f"launching {kind}: {' '.join(server.cmd)}")
    try:
        return {"kind": kind, **measure_server(kind, server, scenarios, cfg, tokenizer)}
    except Exception as err:
        log(f"{kind} failed: {err}\n{server.log_tail(3000)}")
        return {"kind": kind, "error": str(err)}
    finally:
        server.stop()


def run_hf(cfg: CompareConfig, scenarios: list[Scenario]) -> dict[str, Any]:
    """The baseline on the same prompts: sequential for `single` and `prefix`, one static batch
    of the scenario's concurrency for `c8` / `c32`."""
    from berth_runtime.bench.baseline_hf import HFBaseline
    from berth_runtime.models.loader import resolve_model

    path = resolve_model(EMBEDDED_MODEL).path
    plan: dict[str, list[Scenario]] = {}
    for scenario in scenarios:
        batched = scenario.concurrency > 1
        for dtype in cfg.hf_batch_dtypes if batched else cfg.hf_single_dtypes:
            plan.setdefault(dtype, []).append(scenario)
    results: dict[str, Any] = {}
    for dtype, todo in plan.items():
        log(f"HF generate(): loading the model in {dtype}")
        baseline = HFBaseline(path, dtype)
        per_dtype: dict[str, Any] = {"load_time_s": baseline.load_time_s, "scenarios": {}}
        for scenario in todo:
            batch = scenario.concurrency
            baseline.warmup(batch, scenario.requests[0])
            log(f"{baseline.label(batch)}: {scenario.title}")
            if scenario.name == "prefix":
                runs = [
                    baseline.run(scenario.requests[i : i + 2], 1)
                    for i in range(0, len(scenario.requests), 2)
                ]
                per_dtype["scenarios"]["prefix"] = {"runs": runs, **prefix_ttfts(runs)}
            else:
                result = baseline.run(scenario.requests, batch)
                per_dtype["scenarios"][scenario.name] = result
                _log_result(baseline.label(batch), scenario, result)
        results[dtype] = per_dtype
        del baseline
    return results


# ---------------------------------------------------------------------------------------------
# Report


def _get(tree: dict[str, Any] | None, *keys: str) -> Any:
    for key in keys:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _num(value: Any, digits: int = 1, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}{suffix}"


def _ratio(a: Any, b: Any) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def _table(header: list[str], rows: list[list[str]], right_from: int = 2) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            str(c).rjust(w) if i >= right_from else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        )

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def systems(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(display name, {scenario: result}) for every measured system, Berth first."""
    out = []
    for dtype, res in (report.get("berth") or {}).items():
        if "scenarios" in res:
            out.append((berth_name(dtype, res), res["scenarios"]))
    llama = report.get("llama_cpp")
    if llama and "scenarios" in llama:
        out.append((llama["kind"], llama["scenarios"]))
    for dtype, res in (report.get("hf") or {}).items():
        for name, result in res["scenarios"].items():
            sequential = f"HF generate() {dtype} sequential"
            label = sequential if name == "prefix" else result["backend"]
            out.append((label, {name: result}))
    return out


def scenario_table(report: dict[str, Any]) -> str:
    header = ["Scenario", "System", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "decode tok/s"]
    header += ["TPOT p50 ms", "E2E p50 s", "ok"]
    rows: list[list[str]] = []
    for scenario in report["scenarios"]:
        name, title = scenario["name"], scenario["title"]
        if name == "prefix":
            continue
        first = True
        for system, results in systems(report):
            result = results.get(name)
            if result is None:
                continue
            rows.append(
                [
                    title if first else "",
                    system,
                    _num(result["output_throughput"]),
                    _num(result["ttft_ms"]["p50"]),
                    _num(result["ttft_ms"]["p99"]),
                    _num(result["decode_tok_s"]["mean"]),
                    _num(result["tpot_ms"]["p50"]),
                    _num(result["e2e_latency_ms"]["p50"] / 1000, 2),
                    f"{result['completed']}/{result['num_requests']}",
                ]
            )
            first = False
    table = _table(header, rows)
    prefix_rows = []
    for system, results in systems(report):
        prefix = results.get("prefix")
        if prefix:
            cached = prefix.get("cached_tokens_second") or []
            prefix_rows.append(
                [
                    system,
                    _num(prefix["first_ttft_ms"]),
                    _num(prefix["second_ttft_ms"]),
                    _num(prefix["ratio"], 3, "x"),
                    ",".join(str(c) for c in cached) if any(c is not None for c in cached) else "-",
                ]
            )
    if prefix_rows:
        title = next(s["title"] for s in report["scenarios"] if s["name"] == "prefix")
        table += f"\n\n{title}, second request after the first (flushed cache first)\n"
        table += _table(
            ["System", "1st TTFT ms", "2nd TTFT ms", "2nd/1st", "cached tokens (2nd)"],
            prefix_rows,
            right_from=1,
        )
    return table


# How a target's goal reads and is judged: (comparison, threshold, unit).
Goal = tuple[str, float, str]
_OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt}


def _goal_text(goal: Goal) -> str:
    op, threshold, unit = goal
    return f"{op} {threshold:g}{unit}" if unit == "x" else f"{op} {threshold:g} {unit}"


def _judge(value: float | None, goal: Goal) -> bool | None:
    if value is None or math.isnan(value):
        return None
    return _OPS[goal[0]](value, goal[1])


def target_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets for one round, one row each per Berth dtype."""
    hf = report.get("hf") or {}
    rows: list[dict[str, Any]] = []
    for dtype, berth in (report.get("berth") or {}).items():
        scen = berth.get("scenarios")
        if scen is None:
            continue
        tag = berth_name(dtype, berth)

        def add(
            what: str,
            ours: Any,
            base: Any,
            goal: Goal,
            by_ratio: bool = True,
            ratio: float | None = None,
            tag: str = tag,
        ) -> None:
            if by_ratio and ratio is None:
                ratio = _ratio(ours, base)
            rows.append(
                {
                    "system": tag,
                    "target": what,
                    "berth": ours,
                    "baseline": base,
                    "ratio": ratio,
                    "goal": list(goal),
                    "met": _judge(ratio if by_ratio else ours, goal),
                }
            )

        for name, n in (("c32", 32), ("c8", 8)):
            if name in scen:
                add(
                    f"{n} concurrent: output tok/s vs HF bf16 static batch {n}",
                    scen[name]["output_throughput"],
                    _get(hf, "bf16", "scenarios", name, "output_throughput"),
                    (">=", 1.3, "x"),
                )
        if "single" in scen:
            add(
                "single stream: decode tok/s vs HF fp32 sequential",
                scen["single"]["decode_tok_s"]["mean"],
                _get(hf, "fp32", "scenarios", "single", "decode_tok_s", "mean"),
                (">=", 1.5, "x"),
            )
            add(
                "single stream: TTFT p50 ms (HF fp32 alongside)",
                scen["single"]["ttft_ms"]["p50"],
                _get(hf, "fp32", "scenarios", "single", "ttft_ms", "p50"),
                ("<", 100, "ms"),
                by_ratio=False,
            )
        if "prefix" in scen:
            add(
                f"shared {report['config']['prefix_len']}-token prefix: 2nd TTFT / 1st TTFT",
                scen["prefix"]["second_ttft_ms"],
                scen["prefix"]["first_ttft_ms"],
                ("<=", 0.2, "x"),
                ratio=scen["prefix"]["ratio"],
            )
        add(
            "memory: peak server RSS MiB, all processes",
            _get(berth, "memory", "peak_rss_mib"),
            None,
            ("<", 2048, "MiB"),
            by_ratio=False,
        )
    return rows


def _median(values: list[Any]) -> float | None:
    numbers = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(numbers) if numbers else None


def summarize_targets(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per target over every round: the median of each round's ratio (or value), judged
    against the goal, with the per-round figures under `rounds`. Memory takes the highest
    peak instead: a limit holds only if it held in every round."""
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rows in rounds:
        for row in rows:
            grouped.setdefault((row["system"], row["target"]), []).append(row)
    out = []
    for (system, target), rows in grouped.items():
        goal: Goal = tuple(rows[0]["goal"])  # type: ignore[assignment]
        by_ratio = goal[2] == "x"
        if target.startswith("memory"):
            peaks = [r["berth"] for r in rows if r["berth"] is not None]
            ours = max(peaks) if peaks else None
        else:
            ours = _median([r["berth"] for r in rows])
        ratio = _median([r["ratio"] for r in rows]) if by_ratio else None
        out.append(
            {
                "system": system,
                "target": target,
                "berth": ours,
                "baseline": _median([r["baseline"] for r in rows]),
                "ratio": ratio,
                "goal": list(goal),
                "met": _judge(ratio if by_ratio else ours, goal),
                "rounds": [r["ratio"] if by_ratio else r["berth"] for r in rows],
            }
        )
    return out


def targets_table(rows: list[dict[str, Any]]) -> str:
    """The targets; with rounds, the figures are medians and `Rounds` lists each round's."""
    with_rounds = any("rounds" in row for row in rows)
    header = ["System", "Target", "Berth", "Baseline", "Ratio", "Goal", "Met"]
    header += ["Rounds"] if with_rounds else []
    body = []
    for row in rows:
        line = [
            row["system"],
            row["target"],
            _num(row["berth"]),
            _num(row["baseline"]),
            _num(row["ratio"], 2, "x"),
            _goal_text(tuple(row["goal"])),  # type: ignore[arg-type]
            {True: "yes", False: "NO", None: "-"}[row["met"]],
        ]
        if with_rounds:
            digits, suffix = (2, "x") if row["goal"][2] == "x" else (0, "")
            line.append(" / ".join(_num(v, digits, suffix) for v in row.get("rounds", [])))
        body.append(line)
    return _table(header, body)


def render(report: dict[str, Any]) -> str:
    machine = report["machine"]
    cfg = report["config"]
    head = (
        f"Berth vs baseline, {machine['cpus']} CPUs ({machine['platform']}), "
        f"torch threads {machine.get('torch_threads')}; {cfg['input_len']}-token chat prompts, "
        f"{cfg['output_len']} output tokens, greedy, ignore_eos; "
        f"client and server share the machine"
    )
    parts = [head]
    rounds = report.get("rounds") or [report]
    for index, one in enumerate(rounds):
        if len(rounds) > 1:
            parts += ["", f"Round {index + 1} of {len(rounds)}: {' -> '.join(one['order'])}"]
        parts += ["", scenario_table({**report, **one})]
    if report.get("targets"):
        title = "Targets (issue 3)"
        if len(rounds) > 1:
            title += f": medians over {len(rounds)} rounds (memory: the highest peak)"
        parts += ["", title, targets_table(report["targets"])]
    memory_lines = []
    last = rounds[-1]
    for dtype, res in (last.get("berth") or {}).items():
        mem = res.get("memory")
        if mem:
            idle = res.get("idle_memory_mib") or {}
            memory_lines.append(
                f"{berth_name(dtype, res)} server, {idle.get('processes', '?')} processes: "
                f"idle RSS {_num(idle.get('rss_mib'))} MiB, peak RSS {_num(mem['peak_rss_mib'])} "
                f"MiB (sum over processes; PSS at end {_num(mem.get('pss_mib'))} MiB)"
            )
            for proc in idle.get("by_process") or []:
                memory_lines.append(
                    f"  idle: {proc['title']:<60} RSS {_num(proc['rss_mib']):>8} MiB, "
                    f"PSS {_num(proc['pss_mib']):>8} MiB"
                )
    for dtype, res in (last.get("hf") or {}).items():
        mems = [r.get("process_memory") for r in res["scenarios"].values()]
        peak = max((m["peak_rss_mib"] for m in mems if m), default=None)
        memory_lines.append(
            f"HF {dtype}: this process's peak RSS {_num(peak)} MiB so far (client and tokenizer "
            "included; the models of earlier dtypes may still be counted)"
        )
    if memory_lines:
        title = "Memory" + (f" (round {len(rounds)})" if len(rounds) > 1 else "")
        parts += ["", title, *memory_lines]
    for note in report.get("notes", []):
        parts.append(f"note: {note}")
    return "\n".join(parts)


def run_round(
    cfg: CompareConfig, scenarios: list[Scenario], tokenizer: Any, baseline_first: bool
) -> dict[str, Any]:
    """Every configured system once, in this round's order; {system: results, "order": [...]}."""
    runners: list[tuple[str, str, Callable[[], Any]]] = []
    if cfg.run_berth:
        runners.append(("berth", "Berth", lambda: run_berth(cfg, scenarios, tokenizer)))
    if cfg.run_llama_cpp:
        runners.append(("llama_cpp", "llama.cpp", lambda: run_llama_cpp(cfg, scenarios, tokenizer)))
    if cfg.run_hf:
        runners.append(("hf", "HF", lambda: run_hf(cfg, scenarios)))
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
