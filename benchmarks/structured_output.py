"""What structured output costs: output tokens/s with a JSON schema against the same workload
unconstrained, side by side on one `berth serve`, at 1 and 16 concurrent requests.

    python -m benchmarks.structured_output      # or: make bench-structured

The prompts are the same for both: `berth bench`'s random workload. Unconstrained requests decode
`--output-len` tokens (EOS ignored); constrained ones decode until their JSON ends (the workload's
six-record schema: about 250 tokens on the embedded model), with room to spare. Output tokens/s is
what is compared. Each round runs both, alternating which goes first so that the machine's drift
hits both alike; the grammar is compiled by the warm-up request, as a server serving one schema all
day has it cached. The issue's target: constrained at least 0.85x of unconstrained at 16
concurrent.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

from berth_common.server_process import berth_server
from berth_runtime.bench.client import BenchConfig, run_benchmark
from berth_runtime.bench.workload import build_workload, json_schema_format, load_tokenizer

TARGET_AT_16 = 0.85


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--json-schema", default="builtin")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args(argv)

    tokenizer = load_tokenizer()
    response_format = json_schema_format(args.json_schema)
    server = berth_server("serve", *args.server_args, name="berth-structured")
    rows = []
    try:
        server.wait_ready(timeout=600)
        for concurrency in (1, 16):
            requests = build_workload(
                "random",
                tokenizer,
                max(8, 4 * concurrency),
                input_len=(args.input_len, args.input_len),
                output_len=(args.output_len, args.output_len),
            )
            # The same prompts; a constrained answer ends with its JSON, never at max_tokens.
            room = [dataclasses.replace(r, output_len=4 * args.output_len) for r in requests]
            workloads = {"free": requests, "json_schema": room}
            rates: dict[str, list[float]] = {"free": [], "json_schema": []}
            for round_index in range(args.rounds):
                order = ["free", "json_schema"] if round_index % 2 == 0 else ["json_schema", "free"]
                for kind in order:
                    cfg = BenchConfig(
                        base_url=server.base_url,
                        concurrency=concurrency,
                        disable_tqdm=True,
                        tokenizer=tokenizer,
                        extra_body={"response_format": response_format}
                        if kind == "json_schema"
                        else {},
                        label=kind,
                    )
                    result = run_benchmark(cfg, workloads[kind])
                    if result["completed"] != len(requests):
                        print(f"{kind}: {result['completed']}/{len(requests)} completed")
                        return 1
                    cut = sum(r["output_tokens"] >= r["output_len"] for r in result["requests"])
                    if kind == "json_schema" and cut:
                        print(f"{cut} constrained answers hit max_tokens: raise --output-len")
                        return 1
                    rates[kind].append(result["output_throughput"])
                    print(
                        f"[bench] concurrency {concurrency}, round {round_index + 1}, {kind}: "
                        f"{result['output_throughput']:.1f} output tok/s, "
                        f"{result['total_output_tokens'] / len(requests):.0f} tokens per answer",
                        file=sys.stderr,
                    )
            rows.append((concurrency, rates))
    finally:
        server.stop()

    print("\n| Concurrent | Unconstrained, output tok/s | JSON schema, output tok/s | Ratio |")
    print("|---|---|---|---|")
    ratio_at_16 = 0.0
    for concurrency, rates in rows:
        free, constrained = (
            statistics.median(rates["free"]),
            statistics.median(rates["json_schema"]),
        )
        ratio = constrained / free
        if concurrency == 16:
            ratio_at_16 = ratio
        rounds = ", ".join(f"{c / f:.2f}x" for f, c in zip(rates["free"], rates["json_schema"]))
        print(f"| {concurrency} | {free:.1f} | {constrained:.1f} | {ratio:.2f}x ({rounds}) |")
    met = "met" if ratio_at_16 >= TARGET_AT_16 else "NOT met"
    print(f"\nTarget: constrained >= {TARGET_AT_16}x of unconstrained at 16 concurrent ({met})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
