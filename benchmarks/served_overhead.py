"""What serving costs per token: the scheduler's own decode steps in this process against the same
requests through `berth serve` (API, detokenizer, HTTP streaming, the client), side by side.

    python -m benchmarks.served_overhead      # or: make bench-served-overhead

The same greedy chat prompts (48 tokens, 128 out, `ignore_eos`), one at a time and 32 at once.
In-process, a `Scheduler` over a `ModelRunner` at the server's defaults steps until the requests
finish, as the scheduler process does without its sockets; served, the benchmark client streams
them from a server started with the same defaults. The per-token time is the decode time after
the first token over the tokens after it (TPOT); a 32-request batch's is its steps' time. On a
machine of two cores every process of the server and the client shares them with the
scheduler's threads: the difference is what the issue asks to measure. Rounds alternate which
side goes first; medians over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from berth_common.server_process import berth_server
from berth_runtime.bench.client import BenchConfig, run_benchmark
from berth_runtime.bench.workload import BenchRequest, chat_workload, load_tokenizer
from berth_runtime.io_struct import TokenizedGenerateReqInput
from berth_runtime.managers.scheduler import Scheduler
from berth_runtime.managers.scheduler_process import warmup
from berth_runtime.model_executor.model_runner import ModelRunner
from berth_runtime.models.loader import resolve_model
from berth_runtime.models.model_files import read_model_files
from berth_runtime.sampling_params import SamplingParams
from berth_runtime.server_args import ServerArgs


def in_process_ms_per_token(scheduler: Scheduler, requests: list[BenchRequest]) -> float:
    """All `requests` at once through the scheduler's steps: ms per decode step after every
    request has its first token (one request: its TPOT)."""
    for index, request in enumerate(requests):
        params = SamplingParams(max_new_tokens=request.output_len, temperature=0, ignore_eos=True)
        msg = TokenizedGenerateReqInput(f"r{index}", request.prompt_ids, params, stream=True)
        scheduler.handle_generate(msg)
    started: set[str] = set()
    first_all = None
    steps = 0
    with torch.inference_mode():
        while not scheduler.is_idle:
            out = scheduler.step()
            for output in out.outputs if out is not None else []:
                if output.new_token_ids:
                    started.add(output.rid)
            if first_all is None and len(started) == len(requests):
                first_all = time.perf_counter()
            elif first_all is not None:
                steps += 1
    assert first_all is not None and steps > 0
    return (time.perf_counter() - first_all) * 1000 / steps


def served_ms_per_token(base_url: str, requests: list[BenchRequest], tokenizer) -> float:
    """The same requests streamed from the server: the median request's TPOT in ms (one at a
    time), or for a batch sent at once the decode time after the last first token per token."""
    cfg = BenchConfig(
        base_url=base_url, concurrency=len(requests), tokenizer=tokenizer, disable_tqdm=True
    )
    result = run_benchmark(cfg, requests)
    assert result["completed"] == len(requests), result
    per_request = result["requests"]
    if len(requests) == 1:
        return result["tpot_ms"]["p50"]
    last_first = max(r["start"] + r["ttft"] for r in per_request)
    end = max(r["start"] + r["latency"] for r in per_request)
    # The batch's steps after every request has its first token: output_len - 1 of them.
    return (end - last_first) * 1000 / (requests[0].output_len - 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args(argv)

    tokenizer = load_tokenizer()
    workloads = {
        "single stream": chat_workload(tokenizer, 1, seed=1),
        "32 concurrent": chat_workload(tokenizer, 32, seed=2),
    }
    server_args = ServerArgs()
    path = resolve_model(
        server_args.model, server_args.model_cache_dir, server_args.load_format
    ).path
    files = read_model_files(path)
    runner = ModelRunner(path, server_args, config=files.config)
    scheduler = Scheduler(
        server_args,
        runner,
        eos_token_ids=files.eos_token_ids,
        decode=lambda ids: files.tokenizer.decode(ids, skip_special_tokens=True),
    )
    warmup(scheduler)
    server = berth_server("serve", *args.server_args, name="berth-overhead")
    times: dict[tuple[str, str], list[float]] = {}
    try:
        server.wait_ready(timeout=600)
        for name, requests in workloads.items():
            for round_index in range(args.rounds):
                order = ["in-process", "served"]
                for side in order if round_index % 2 == 0 else order[::-1]:
                    if side == "served":
                        ms = served_ms_per_token(server.base_url, requests, tokenizer)
                    else:
                        ms = in_process_ms_per_token(scheduler, requests)
                    times.setdefault((name, side), []).append(ms)
                    print(
                        f"[bench] {name}, round {round_index + 1}, {side}: {ms:.2f} ms/step",
                        file=sys.stderr,
                    )
    finally:
        server.stop()

    print("\n| Workload | In-process, ms per decode step | Served | Served / in-process |")
    print("|---|---|---|---|")
    for name in workloads:
        inside = statistics.median(times[(name, "in-process")])
        served = statistics.median(times[(name, "served")])
        print(f"| {name} | {inside:.2f} | {served:.2f} | {served / inside:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
