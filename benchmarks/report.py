"""The comparison's report as text: a table per scenario, and the targets, judged in each round
and on the medians over the rounds."""

from __future__ import annotations

import math
import operator
import statistics
from collections.abc import Callable
from typing import Any

from benchmarks.systems import differing_answers


def berth_name(key: str, result: dict[str, Any]) -> str:
    """ "Berth (float32)", or "Berth (auto: float32)" with the dtype the server chose; a variant
    server (`BERTH_VARIANTS` in compare.py) adds its name: "Berth (auto: bfloat16, ngram)"."""
    dtype = result.get("dtype") or key
    chosen = _get(result, "server_info", "engine", "dtype")
    name = f"{dtype}: {chosen}" if dtype == "auto" and chosen else dtype
    variant = result.get("variant")
    return f"Berth ({name}, {variant})" if variant else f"Berth ({name})"


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
    """The targets for one round, one row each per Berth dtype: issue 3's against HF, issue 19's
    against llama.cpp's server, and those of the variant servers against the same dtype's
    defaults."""
    hf = report.get("hf") or {}
    llama = _get(report, "llama_cpp", "scenarios") or {}
    servers = report.get("berth") or {}
    rows: list[dict[str, Any]] = []
    for dtype, berth in servers.items():
        scen = berth.get("scenarios")
        if scen is None or berth.get("variant"):
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
        if llama:
            _llama_rows(add, scen, llama)
            add(
                "memory: whole-server PSS MiB after the last scenario",
                _get(berth, "memory", "pss_mib"),
                None,
                ("<=", 1024, "MiB"),
                by_ratio=False,
            )
        _variant_rows(
            add, scen, servers.get(f"{dtype} ngram"), servers.get(f"{dtype} deterministic")
        )
    return rows


# Issue 19's targets against llama.cpp's server: (what, scenario, result path, goal).
_LLAMA_TARGETS: list[tuple[str, str, tuple[str, ...], Goal]] = [
    ("single stream: decode tok/s", "single", ("decode_tok_s", "mean"), (">=", 1.1, "x")),
    ("single stream: TTFT p50", "single", ("ttft_ms", "p50"), ("<=", 1.0, "x")),
    ("8 concurrent: output tok/s", "c8", ("output_throughput",), (">=", 2.0, "x")),
    ("32 concurrent: output tok/s", "c32", ("output_throughput",), (">=", 3.5, "x")),
]


def _llama_rows(add: Callable[..., None], scen: dict[str, Any], llama: dict[str, Any]) -> None:
    """Issue 19's targets: ratios to llama.cpp's server on the same scenarios."""
    for what, name, path, goal in _LLAMA_TARGETS:
        present = name in scen and name in llama
        ours = _get(scen[name], *path) if present else None
        theirs = _get(llama[name], *path) if present else None
        add(f"{what} vs llama-server", ours, theirs, goal)


def _variant_rows(
    add: Callable[..., None],
    scen: dict[str, Any],
    ngram: dict[str, Any] | None,
    deterministic: dict[str, Any] | None,
) -> None:
    """The speculative server's gain on the rewrite workload (and its answers: plain decoding's),
    and the deterministic mode's cost (and whether any answer depended on its batch)."""
    spec = _get(ngram, "scenarios", "rewrite")
    if spec and "rewrite" in scen:
        tag = berth_name("", ngram)  # type: ignore[arg-type]
        add(
            "rewrite, single stream: decode tok/s with ngram speculation vs without",
            spec["decode_tok_s"]["mean"],
            scen["rewrite"]["decode_tok_s"]["mean"],
            (">=", 2.0, "x"),
            tag=tag,
        )
        add(
            "rewrite: answers that differ from plain decoding's",
            differing_answers(spec, scen["rewrite"]),
            None,
            ("<=", 0, "answers"),
            by_ratio=False,
            tag=tag,
        )
    det = _get(deterministic, "scenarios", "deterministic")
    if det and "deterministic" in scen:
        tag = berth_name("", deterministic)  # type: ignore[arg-type]
        n = len(det["requests"])
        add(
            f"{n} concurrent: output tok/s, deterministic mode vs defaults (its cost)",
            det["output_throughput"],
            scen["deterministic"]["output_throughput"],
            (">=", 0.9, "x"),
            tag=tag,
        )
        for server, result in ((tag, det), (None, scen["deterministic"])):
            add(
                f"{n} concurrent: answers that differ from one at a time",
                result.get("differ_from_solo"),
                None,
                ("<=", 0, "answers"),
                by_ratio=False,
                **({"tag": server} if server else {}),
            )


def _median(values: list[Any]) -> float | None:
    numbers = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(numbers) if numbers else None


def summarize_targets(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per target over every round: the median of each round's ratio (or value), judged
    against the goal, with the per-round figures under `rounds`. Memory and differing answers
    take the highest instead: a limit holds only if it held in every round."""
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rows in rounds:
        for row in rows:
            grouped.setdefault((row["system"], row["target"]), []).append(row)
    out = []
    for (system, target), rows in grouped.items():
        goal: Goal = tuple(rows[0]["goal"])  # type: ignore[assignment]
        by_ratio = goal[2] == "x"
        if target.startswith("memory") or goal[2] == "answers":
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
        title = "Targets (issue 3: against HF; issue 19: against llama-server, and Berth's modes)"
        if len(rounds) > 1:
            title += f": medians over {len(rounds)} rounds (memory, answers: the highest)"
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
