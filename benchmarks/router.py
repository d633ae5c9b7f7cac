"""Benchmark `berth router`: its added latency against calling a rank directly, and the prefix-cache
hit rate of `cache_aware` against `round_robin` on a shared-prefix workload, side by side.

    python -m benchmarks.router                 # starts 3 ranks and the routers itself
    python -m benchmarks.router --worker-urls http://h:30000 http://h:30001 ...

Both parts run in one process against the same ranks. Latency is measured with interleaved
requests (direct, routed, direct, ...) on keep-alive connections, so drift hits both sides alike.
The hit rate is what the ranks report (`usage.prompt_tokens_details.cached_tokens` over
`prompt_tokens`), with every rank's cache (and the router's tree) flushed before each policy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from berth_common.server_process import ServerProcess, berth_server
from berth_runtime.bench.metrics import percentile

WORDS = [
    "anchor",
    "berth",
    "bollard",
    "cargo",
    "crane",
    "dock",
    "ensign",
    "ferry",
    "gantry",
    "harbour",
    "hull",
    "jetty",
    "keel",
    "ledger",
    "manifest",
    "mooring",
    "pallet",
    "pier",
    "pilot",
    "quay",
    "reefer",
    "rudder",
    "stevedore",
    "tide",
    "tug",
    "vessel",
    "wharf",
    "yard",
]


def start_ranks(args: argparse.Namespace) -> tuple[list[str], list[ServerProcess]]:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # Ranks share the machine: one OpenMP pool each, sized to its share of the cores.
    threads = str(max(1, (cpus or 1) // args.ranks))
    procs = []
    for rank in range(args.ranks):
        argv = ["--dp-rank", str(rank), "--model", args.model]
        argv += ["--max-total-tokens", str(args.max_total_tokens), "--log-level", "warning"]
        env = {"OMP_NUM_THREADS": threads}
        procs.append(berth_server("serve", *argv, name=f"berth-bench-rank{rank}", env=env))
    for proc in procs:
        proc.wait_ready(timeout=600)
    return [proc.base_url for proc in procs], procs


def start_router(policy: str, urls: list[str]) -> tuple[str, ServerProcess]:
    argv = ["--policy", policy, "--log-level", "warning", "--worker-urls", *urls]
    proc = berth_server("router", *argv, name=f"berth-bench-router-{policy}")
    proc.wait_ready(timeout=60)
    return proc.base_url, proc


# --- added latency -----------------------------------------------------------------------------


def measure_latency(
    direct_url: str, router_url: str, model: str, requests: int
) -> list[dict[str, Any]]:
    """Interleaved direct / routed timings of a proxy-only GET and of a one-token completion."""
    cases = [
        ("GET /v1/models", "GET", "/v1/models", None),
        (
            "POST /v1/completions (1 token)",
            "POST",
            "/v1/completions",
            {"model": model, "prompt": "The harbour", "max_tokens": 1, "temperature": 0},
        ),
    ]
    rows = []
    with httpx.Client(timeout=60) as direct, httpx.Client(timeout=60) as routed:
        for name, method, path, body in cases:
            times: dict[str, list[float]] = {"direct": [], "router": []}
            for i in range(requests + 5):
                order = [("direct", direct, direct_url), ("router", routed, router_url)]
                for side, client, base in order if i % 2 == 0 else order[::-1]:
                    start = time.perf_counter()
                    response = client.request(method, f"{base}{path}", json=body)
                    elapsed = time.perf_counter() - start
                    response.raise_for_status()
                    if i >= 5:  # warm-up: connections, first-request paths
                        times[side].append(elapsed * 1000)
            row: dict[str, Any] = {"case": name, "requests": requests}
            for side in ("direct", "router"):
                row[f"{side}_p50_ms"] = statistics.median(times[side])
                row[f"{side}_p99_ms"] = percentile(times[side], 99)
            row["added_p50_ms"] = row["router_p50_ms"] - row["direct_p50_ms"]
            row["added_p99_ms"] = row["router_p99_ms"] - row["direct_p99_ms"]
            rows.append(row)
    return rows


# --- prefix-cache hit rate ---------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    group: int
    prompt: str


def shared_prefix_workload(groups: int, per_group: int, prefix_words: int, seed: int) -> list[Job]:
    """`groups` long system prompts, each followed by `per_group` short distinct questions."""
    rng = random.Random(seed)
    jobs = []
    for g in range(groups):
        words = " ".join(rng.choice(WORDS) for _ in range(prefix_words))
        prefix = f"Terminal {g} operating manual. {words}\n\n"
        for q in range(per_group):
            ship = " ".join(rng.choice(WORDS) for _ in range(6))
            jobs.append(Job(g, f"{prefix}Question {q}: where should the {ship} go?"))
    rng.shuffle(jobs)
    return jobs


def run_hit_rate(router_url: str, model: str, jobs: list[Job], concurrency: int) -> dict[str, Any]:
    flushed = httpx.post(f"{router_url}/flush_cache", timeout=60)
    if flushed.status_code != 200:
        raise RuntimeError(f"flushing the ranks' caches failed: {flushed.text}")

    def one(job: Job) -> tuple[int, int, int, int]:
        body = {"model": model, "prompt": job.prompt, "max_tokens": 1, "temperature": 0}
        response = httpx.post(f"{router_url}/v1/completions", json=body, timeout=600)
        response.raise_for_status()
        usage = response.json()["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        rank = int(response.headers.get("x-data-parallel-rank", -1))
        return job.group, rank, usage["prompt_tokens"], cached

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, jobs))
    wall = time.perf_counter() - start
    prompt = sum(r[2] for r in results)
    cached = sum(r[3] for r in results)
    ranks_per_group: dict[int, set[int]] = defaultdict(set)
    for group, rank, _, _ in results:
        ranks_per_group[group].add(rank)
    return {
        "requests": len(results),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ranks_per_group": statistics.mean(len(r) for r in ranks_per_group.values()),
        "requests_per_rank": dict(sorted(Counter(r[1] for r in results).items())),
        "wall_s": wall,
    }


# --- main --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.router",
        description="Router added latency vs a direct rank, and cache_aware vs round_robin "
        "prefix-cache hit rate on a shared-prefix workload.",
    )
    p.add_argument(
        "--worker-urls", nargs="*", default=[], help="Use running ranks (rank i = i-th)."
    )
    p.add_argument("--ranks", type=int, default=3, help="Ranks to start when no URLs are given.")
    p.add_argument("--model", default="builtin://smollm2-135m-instruct", help="Model of the ranks.")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV capacity per rank.")
    p.add_argument("--latency-requests", type=int, default=200, help="Timed requests per side.")
    p.add_argument("--groups", type=int, default=6, help="Distinct shared prefixes.")
    p.add_argument("--per-group", type=int, default=6, help="Requests per shared prefix.")
    p.add_argument("--prefix-words", type=int, default=300, help="Words per shared prefix.")
    p.add_argument("--concurrency", type=int, default=4, help="Requests in flight at once.")
    p.add_argument(
        "--policies",
        nargs="+",
        default=["cache_aware", "round_robin"],
        choices=["cache_aware", "least_load", "round_robin"],
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="Also write the results as JSON here.")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    procs: list[ServerProcess] = []
    try:
        if args.worker_urls:
            urls = [u.rstrip("/") for u in args.worker_urls]
        else:
            print(f"Starting {args.ranks} ranks ({args.model}) ...", flush=True)
            urls, rank_procs = start_ranks(args)
            procs += rank_procs
        routers = {}
        for policy in dict.fromkeys(["cache_aware", *args.policies]):
            url, proc = start_router(policy, urls)
            routers[policy] = url
            procs.append(proc)
        model = httpx.get(f"{urls[0]}/v1/models", timeout=30).json()["data"][0]["id"]

        print(
            f"\nRouter added latency ({args.latency_requests} requests per side, interleaved, "
            "keep-alive; router policy cache_aware)"
        )
        latency = measure_latency(urls[0], routers["cache_aware"], model, args.latency_requests)
        print(
            f"{'case':34} {'direct p50':>11} {'router p50':>11} {'added p50':>10} "
            f"{'direct p99':>11} {'router p99':>11} {'added p99':>10}"
        )
        for row in latency:
            print(
                f"{row['case']:34} {row['direct_p50_ms']:9.2f}ms {row['router_p50_ms']:9.2f}ms "
                f"{row['added_p50_ms']:8.2f}ms {row['direct_p99_ms']:9.2f}ms "
                f"{row['router_p99_ms']:9.2f}ms {row['added_p99_ms']:8.2f}ms"
            )

        jobs = shared_prefix_workload(args.groups, args.per_group, args.prefix_words, args.seed)
        print(
            f"\nPrefix-cache hit rate: {args.groups} shared prefixes x {args.per_group} "
            f"requests ({args.prefix_words}-word prefixes), shuffled, concurrency "
            f"{args.concurrency}, {len(urls)} ranks; caches flushed before each policy"
        )
        print(
            f"{'policy':12} {'hit rate':>9} {'cached / prompt tokens':>24} "
            f"{'ranks per prefix':>17} {'requests per rank':>20} {'wall':>8}"
        )
        hit_rates = {}
        for policy in args.policies:
            result = run_hit_rate(routers[policy], model, jobs, args.concurrency)
            hit_rates[policy] = result
            per_rank = " ".join(f"{r}:{n}" for r, n in result["requests_per_rank"].items())
            tokens = f"{result['cached_tokens']} / {result['prompt_tokens']}"
            print(
                f"{policy:12} {result['hit_rate']:8.1%} {tokens:>24} "
                f"{result['ranks_per_group']:17.2f} {per_rank:>20} {result['wall_s']:7.1f}s"
            )
        if args.json:
            Path(args.json).write_text(
                json.dumps({"latency": latency, "hit_rate": hit_rates}, indent=2)
            )
        return 0
    finally:
        for proc in reversed(procs):
            proc.stop()


if __name__ == "__main__":
    sys.exit(main())
