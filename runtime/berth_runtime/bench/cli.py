"""The `berth bench` command line: `berth bench [run] ...` (the comparison with baselines is
`make bench`, from the repository's `benchmarks/`)."""

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


def positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return number


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="berth bench",
        description="Benchmark an OpenAI-compatible server with a seeded synthetic workload "
        "(Berth vs HF transformers side by side: `make bench` in a checkout).",
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
    work.add_argument("--num-prompts", type=positive, default=32)
    work.add_argument(
        "--input-len",
        type=_length,
        help="prompt tokens, N or MIN:MAX (uniform); chat API: the rendered template "
        "(random: 256, chat: 48)",
    )
    work.add_argument("--output-len", type=_length, help="output tokens, N or MIN:MAX (128)")
    work.add_argument("--shared-prefix-len", type=positive, default=2000, help="shared-prefix: P")
    work.add_argument(
        "--question-len", type=positive, default=32, help="shared-prefix: tokens after the prefix"
    )
    work.add_argument(
        "--num-groups", type=positive, default=1, help="shared-prefix: groups (distinct prefixes)"
    )
    work.add_argument("--tokenizer", help="tokenizer directory (default: the embedded model's)")
    work.add_argument(
        "--json-schema",
        help="structured output: constrain every answer to this JSON schema (response_format "
        "json_schema): 'builtin' (six records), a file, or the schema's JSON; answers end when "
        "the JSON does",
    )
    work.add_argument("--seed", type=int, default=0, help="seeds prompts and Poisson arrivals")

    load = p.add_argument_group("load")
    load.add_argument(
        "--concurrency",
        type=positive,
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


def run_main(argv: list[str]) -> int:
    args = run_parser().parse_args(argv)
    import aiohttp

    from berth_runtime.bench.client import BenchConfig, run_benchmark
    from berth_runtime.bench.metrics import format_summary
    from berth_runtime.bench.workload import build_workload, json_schema_format, load_tokenizer

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
    try:
        extra_body = (
            {"response_format": json_schema_format(args.json_schema)} if args.json_schema else {}
        )
    except (OSError, ValueError) as err:
        run_parser().error(f"--json-schema: {err}")
    server = None
    base_url, server_pid = args.base_url, args.server_pid
    if args.launch_server:
        from berth_common.server_process import berth_server

        server = berth_server("serve", *shlex.split(args.server_args), name="berth-bench")
        print(f"[bench] launched {' '.join(server.cmd)}", file=sys.stderr)
        try:
            server.wait_ready(timeout=600)
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
        extra_body=extra_body,
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


def _without_requests(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k != "requests"}


def _write_json(data: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "compare":
        run_parser().error(
            "`berth bench compare` moved to the repository's benchmarks/: run `make bench` "
            "(or `python -m benchmarks.compare`) in a checkout"
        )
    if argv and argv[0] == "run":
        argv = argv[1:]
    return run_main(argv)


if __name__ == "__main__":
    sys.exit(main())
