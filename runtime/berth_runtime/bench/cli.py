"""The `berth bench` command line: `berth bench [run] ...` and `berth bench compare ...`."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from typing import Any

from berth_runtime.bench.workload import APIS, WORKLOADS, parse_len_range

RUN_EPILOG = """\
examples:
  berth bench --workload chat --num-prompts 32 --concurrency 8
  berth bench --workload random --input-len 128:512 --output-len 64 --request-rate 2
  berth bench --workload shared-prefix --num-groups 4 --num-prompts 32 --shared-prefix-len 2000
  berth bench --launch-server --server-args "--dtype bfloat16" --output-file result.json
"""

COMPARE_EPILOG = """\
The quick default (two rounds, Berth first then the baseline first) finishes in about five
minutes on 2 cores; --full runs three rounds, more prompts per scenario and both dtypes for the
baseline. `make bench BENCH_ARGS="--full"` does the same.
"""


def _rate(value: str) -> float:
    rate = float(value)
    if not rate > 0:
        raise argparse.ArgumentTypeError("the request rate must be > 0 (or inf)")
    return rate


def _length(value: str) -> tuple[int, int]:
    try:
        return parse_len_range(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return number


def _csv(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="berth bench",
        description="Benchmark an OpenAI-compatible server with a seeded synthetic workload "
        "(`berth bench compare --help`: Berth vs HF transformers side by side).",
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = p.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:30000", help="server root URL")
    target.add_argument("--model", help="model name to send (default: first of /v1/models)")
    target.add_argument("--api", choices=APIS, default="chat", help="endpoint to stream from")
    target.add_argument(
        "--api-key", default=os.environ.get("BERTH_API_KEY"), help="bearer token ($BERTH_API_KEY)"
    )
    target.add_argument(
        "--server-pid", type=int, help="sum the RSS of this process and its descendants"
    )
    target.add_argument(
        "--launch-server",
        action="store_true",
        help="start `berth serve` on a free port for the run (its memory is measured), then stop",
    )
    target.add_argument(
        "--server-args", default="", help='flags for the launched server, e.g. "--dtype bfloat16"'
    )
    target.add_argument(
        "--flush-cache", action="store_true", help="POST /flush_cache before the timed run"
    )

    work = p.add_argument_group("workload")
    work.add_argument("--workload", choices=WORKLOADS, default="random")
    work.add_argument("--num-prompts", type=_positive, default=32)
    work.add_argument(
        "--input-len",
        type=_length,
        help="prompt tokens, N or MIN:MAX (uniform); chat API: the rendered template "
        "(random: 256, chat: 48)",
    )
    work.add_argument("--output-len", type=_length, help="output tokens, N or MIN:MAX (128)")
    work.add_argument("--shared-prefix-len", type=_positive, default=2000, help="shared-prefix: P")
    work.add_argument(
        "--question-len", type=_positive, default=32, help="shared-prefix: tokens after the prefix"
    )
    work.add_argument(
        "--num-groups", type=_positive, default=1, help="shared-prefix: groups (distinct prefixes)"
    )
    work.add_argument("--tokenizer", help="tokenizer directory (default: the embedded model's)")
    work.add_argument("--seed", type=int, default=0, help="seeds prompts and Poisson arrivals")

    load = p.add_argument_group("load")
    load.add_argument(
        "--concurrency",
        type=_positive,
        help="closed loop: at most N requests in flight (default: unbounded)",
    )
    load.add_argument(
        "--request-rate",
        type=_rate,
        default=math.inf,
        help="open loop: Poisson arrivals per second (default inf: all at once)",
    )
    load.add_argument("--warmup-requests", type=int, default=1, help="untimed requests first")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (output lengths then vary)",
    )
    load.add_argument("--request-timeout", type=float, default=3 * 3600.0, help="seconds")

    out = p.add_argument_group("output")
    out.add_argument("--output-file", help="write the result as JSON here")
    out.add_argument(
        "--no-details", action="store_true", help="leave per-request timings out of the JSON"
    )
    out.add_argument("--disable-tqdm", action="store_true")
    return p


def compare_parser() -> argparse.ArgumentParser:
    from berth_runtime.bench.compare import SCENARIOS

    p = argparse.ArgumentParser(
        prog="berth bench compare",
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
    p.add_argument("--num-single", type=_positive, help="prompts, single stream (quick 3)")
    p.add_argument("--num-c8", type=_positive, help="prompts at 8 concurrent (quick 8)")
    p.add_argument("--num-c32", type=_positive, help="prompts at 32 concurrent (quick 32)")
    p.add_argument("--input-len", type=_positive, help="chat prompt tokens (48)")
    p.add_argument("--output-len", type=_positive, help="output tokens (128)")
    p.add_argument("--prefix-len", type=_positive, help="shared prefix tokens (2000)")
    p.add_argument("--prefix-groups", type=_positive, help="shared-prefix pairs (quick 1)")
    p.add_argument(
        "--rounds",
        type=_positive,
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


def run_main(argv: list[str]) -> int:
    args = run_parser().parse_args(argv)
    import aiohttp

    from berth_runtime.bench.client import BenchConfig, run_benchmark
    from berth_runtime.bench.metrics import format_summary
    from berth_runtime.bench.workload import build_workload, load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    try:
        requests = build_workload(
            args.workload,
            tokenizer,
            args.num_prompts,
            api=args.api,
            input_len=args.input_len,
            output_len=args.output_len,
            seed=args.seed,
            prefix_len=args.shared_prefix_len,
            question_len=args.question_len,
            num_groups=args.num_groups,
        )
    except ValueError as err:
        run_parser().error(str(err))
    server = None
    base_url, server_pid = args.base_url, args.server_pid
    if args.launch_server:
        from berth_runtime.bench.server import launch_berth

        server = launch_berth(shlex.split(args.server_args))
        print(f"[bench] launched {' '.join(server.cmd)}", file=sys.stderr)
        try:
            server.wait_ready()
        except Exception as err:
            server.stop()
            print(f"[bench] the server did not start: {err}", file=sys.stderr)
            return 1
        base_url, server_pid = server.base_url, server.pid
    cfg = BenchConfig(
        base_url=base_url,
        api=args.api,
        model=args.model,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        seed=args.seed,
        warmup_requests=args.warmup_requests,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        request_timeout=args.request_timeout,
        api_key=args.api_key,
        server_pid=server_pid,
        disable_tqdm=args.disable_tqdm,
        flush_cache=args.flush_cache,
        tokenizer=tokenizer,
        label="berth" if server else "",
    )
    try:
        result = run_benchmark(cfg, requests)
    except (aiohttp.ClientError, RuntimeError) as err:
        print(f"[bench] cannot benchmark {base_url}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    result["workload"] = args.workload
    result["workload_args"] = {
        "input_len": args.input_len,
        "output_len": args.output_len,
        "shared_prefix_len": args.shared_prefix_len if args.workload == "shared-prefix" else None,
        "question_len": args.question_len if args.workload == "shared-prefix" else None,
        "num_groups": args.num_groups if args.workload == "shared-prefix" else None,
    }
    print(format_summary(result))
    if args.output_file:
        _write_json(result if not args.no_details else _without_requests(result), args.output_file)
        print(f"[bench] wrote {args.output_file}", file=sys.stderr)
    return 0 if result["completed"] == result["num_requests"] else 1


def compare_main(argv: list[str]) -> int:
    args = compare_parser().parse_args(argv)
    from berth_runtime.bench.compare import (
        SCENARIOS,
        CompareConfig,
        compare,
        failed_berth_runs,
        render,
        write_report,
    )

    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        compare_parser().error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
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


def _without_requests(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k != "requests"}


def _write_json(data: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "compare":
        return compare_main(argv[1:])
    if argv and argv[0] == "run":
        argv = argv[1:]
    return run_main(argv)


if __name__ == "__main__":
    sys.exit(main())
