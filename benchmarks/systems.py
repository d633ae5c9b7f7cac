"""Measure each system of the comparison on its scenarios: Berth (`berth serve`, launched here),
llama.cpp's server (when installed) and HF transformers `generate()` in this process."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from berth_common.server_process import ServerProcess, berth_server, free_port
from berth_runtime.bench.client import BenchConfig, run_benchmark
from berth_runtime.bench.memory import tree_memory
from berth_runtime.bench.workload import EMBEDDED_MODEL
from berth_runtime.utils import cpu_isa

if TYPE_CHECKING:
    from benchmarks.compare import CompareConfig, Scenario

MIB = 1024 * 1024


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


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
    server: ServerProcess,
    scenarios: list[Scenario],
    cfg: CompareConfig,
    tokenizer: Any,
) -> dict[str, Any]:
    """Every scenario against one running server; peak memory over the whole session."""
    startup = server.wait_ready(timeout=600).startup_s
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
            ignore_eos=scenario.ignore_eos,
            keep_text=scenario.name in ("rewrite", "deterministic"),  # answers compared
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
            if scenario.name == "deterministic":
                bench.concurrency, bench.warmup_requests = 1, 0
                solo = run_benchmark(bench, scenario.requests)
                result["differ_from_solo"] = differing_answers(result, solo)
                log(f"{name}: {result['differ_from_solo']} answers differ from one at a time")
        for memory in memories:
            peak = max(peak, memory.get("peak_rss_mib") or 0.0)
            last_pss = memory.get("pss_mib") or last_pss
    out["memory"] = {"peak_rss_mib": peak, "pss_mib": last_pss}
    return out


def differing_answers(a: dict[str, Any], b: dict[str, Any]) -> int | None:
    """How many requests two runs of the same workload answered differently (a failed request
    counts as different); None without the texts."""
    pairs = list(zip(a["requests"], b["requests"]))
    if not pairs or any("generated_text" not in r for pair in pairs for r in pair):
        return None
    return sum(
        not (x["success"] and y["success"] and x["generated_text"] == y["generated_text"])
        for x, y in pairs
    )


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


def _log_result(name: str, scenario: Scenario, result: dict[str, Any]) -> None:
    log(
        f"{name} {scenario.name}: {result['output_throughput']:.1f} out tok/s, "
        f"TTFT p50 {result['ttft_ms']['p50']:.0f} ms, "
        f"decode {result['decode_tok_s']['mean']:.1f} tok/s/stream, "
        f"{result['completed']}/{result['num_requests']} ok"
    )


def run_berth(
    cfg: CompareConfig,
    scenarios: list[Scenario],
    tokenizer: Any,
    variants: dict[str, tuple[list[str], tuple[str, ...]]],
) -> dict[str, Any]:
    """One server per dtype at the defaults, on every scenario; then, per dtype, one per variant
    (`variants`: name -> its flags and the scenarios it runs), keyed "{dtype} {variant}"."""
    results: dict[str, Any] = {}
    for dtype in cfg.berth_dtypes:
        base = ([] if dtype == "auto" else ["--dtype", dtype]) + cfg.server_args
        runs = [(dtype, None, base, scenarios)]
        for variant, (flags, names) in variants.items():
            chosen = [s for s in scenarios if s.name in names]
            if chosen:
                runs.append((f"{dtype} {variant}", variant, base + flags, chosen))
        for key, variant, args, todo in runs:
            log(f"launching berth serve {' '.join(args)}".rstrip())
            server = berth_server("serve", *args, name="berth-bench")
            try:
                result = measure_server(f"Berth {key}", server, todo, cfg, tokenizer)
                results[key] = result
            except Exception as err:
                log(f"Berth {key} failed: {err}\n{server.log_tail(3000)}")
                results[key] = result = {"error": str(err)}
            finally:
                code = server.stop()
                log(f"berth serve stopped (exit code {code}); log: {server.log_path}")
            result.update(server_args=args, dtype=dtype, variant=variant)
    return results


def find_llama_cpp() -> tuple[str, list[str]] | None:
    """How to start llama.cpp's server here: ("llama-server", argv prefix) for one on PATH or
    built by `make llama-server`, or ("llama_cpp.server", argv prefix) for llama-cpp-python's;
    None when none is installed. Under BERTH_CPU_ISA=avx2 only the AVX2 build counts (`make
    llama-server LLAMA_ISA=avx2`): Berth and llama.cpp then both run AVX2 code."""
    if cpu_isa.isa_cap() is not None:
        binary = built_llama_server()
        return ("llama-server", [binary]) if binary else None
    binary = shutil.which("llama-server") or built_llama_server()
    if binary:
        return "llama-server", [binary]
    if importlib.util.find_spec("llama_cpp") is not None:
        with contextlib.suppress(ImportError, ValueError):
            if importlib.util.find_spec("llama_cpp.server") is not None:
                return "llama_cpp.server", [sys.executable, "-m", "llama_cpp.server"]
    return None


def built_llama_server() -> str | None:
    """The llama-server `make llama-server` (hack/llama-server/build.sh) built, if it did."""
    script = Path(__file__).parents[1] / "hack" / "llama-server" / "build.sh"
    if not script.is_file():
        return None
    isa = cpu_isa.isa_cap() or "native"
    result = subprocess.run(
        ["bash", str(script), "--print-path"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "LLAMA_ISA": isa},
    )
    path = result.stdout.strip()
    return path if result.returncode == 0 and os.access(path, os.X_OK) else None


def launch_llama_cpp(
    kind: str, prefix: list[str], gguf: str, parallel: int, ctx_per_slot: int
) -> ServerProcess:
    """llama.cpp's server on the GGUF file: continuous batching over `parallel` slots."""
    port = free_port()
    threads = str(os.cpu_count() or 1)
    if kind == "llama-server":
        cmd = [
            *prefix,
            *("-m", gguf, "--host", "127.0.0.1", "--port", str(port)),
            *("-np", str(parallel), "-c", str(parallel * ctx_per_slot), "-t", threads),
            "--cont-batching",
        ]
        return ServerProcess(cmd, port, "/health", name="llama-server")
    cmd = [
        *prefix,
        *("--model", gguf, "--host", "127.0.0.1", "--port", str(port)),
        *("--n_ctx", str(ctx_per_slot), "--n_threads", threads),
    ]
    return ServerProcess(cmd, port, "/v1/models", name="llama_cpp.server")


def run_llama_cpp(
    cfg: CompareConfig, scenarios: list[Scenario], tokenizer: Any
) -> dict[str, Any] | None:
    found = find_llama_cpp()
    if found is None:
        log("llama.cpp: neither `llama-server` nor `llama_cpp.server` is installed; skipped")
        return None
    kind, prefix = found
    from berth_runtime.models.loader import builtin_gguf_path  # the embedded model's GGUF

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
    from benchmarks.baseline_hf import HFBaseline
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
