"""Where `berth serve` should template and tokenize prompts: on the event loop, on worker threads,
or in worker processes (SGLang's `--tokenizer-worker-num`), measured side by side in one run.

    python -m benchmarks.tokenizer_workers      # or: make bench-tokenizer

The API process's job, on the embedded model's tokenizer: apply the chat template to a request's
messages and tokenize the result, for a burst of concurrent requests (short chat turns and long
documents mixed). For each way of running that work, it reports requests per second and the
event loop's longest stall (what `/health` and every stream wait behind), measured by a 1 ms ticker
on the same loop. Process workers pay for sending the messages and the token ids between
processes; threads share one interpreter, and the tokenizer's Rust code releases the GIL while it
encodes.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from berth_runtime.models.loader import resolve_model

_tokenizer: Any = None


def load(model_path: str) -> None:
    """Load the tokenizer once per worker (and once in this process)."""
    global _tokenizer
    from transformers import AutoTokenizer

    _tokenizer = AutoTokenizer.from_pretrained(model_path)


def template_and_tokenize(messages: list[dict[str, str]]) -> list[int]:
    """What the API process does for each chat request before it reaches the scheduler."""
    text = _tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return _tokenizer(text).input_ids


def workload(requests: int, long_every: int, long_words: int) -> list[list[dict[str, str]]]:
    """Short chat turns, with a long document every `long_every` requests."""
    out = []
    for i in range(requests):
        if i % long_every == 0:
            content = "Summarise this: " + " ".join(f"w{i}x{j}" for j in range(long_words))
        else:
            content = f"Question {i}: what is the capital of country number {i}?"
        out.append(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
        )
    return out


@dataclass(frozen=True)
class Result:
    name: str
    requests_per_s: float
    worst_stall_ms: float
    tokens: int


async def run_burst(
    name: str, submit: Callable[[list[dict[str, str]]], Any], batch: list[list[dict[str, str]]]
) -> Result:
    """Submit every request at once; a ticker on the loop records the longest gap between ticks."""
    stalls: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            stalls.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    started = time.perf_counter()
    results = await asyncio.gather(*(submit(messages) for messages in batch))
    elapsed = time.perf_counter() - started
    done.set()
    await tick
    return Result(name, len(batch) / elapsed, max(stalls) * 1000, sum(len(r) for r in results))


def on_loop() -> Callable[[list[dict[str, str]]], Any]:
    async def submit(messages: list[dict[str, str]]) -> list[int]:
        return template_and_tokenize(messages)

    return submit


def on_executor(executor: Executor) -> Callable[[list[dict[str, str]]], Any]:
    async def submit(messages: list[dict[str, str]]) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(
            executor, template_and_tokenize, messages
        )

    return submit


async def compare(model_path: str, args: argparse.Namespace) -> list[Result]:
    batch = workload(args.requests, args.long_every, args.long_words)
    load(model_path)
    template_and_tokenize(batch[0])  # warm the template's compilation
    threads = {n: ThreadPoolExecutor(n) for n in (1, args.workers)}
    processes = ProcessPoolExecutor(args.workers, initializer=load, initargs=(model_path,))
    # Warm every process worker (its tokenizer load is start-up cost, not per-request cost).
    await asyncio.gather(*(on_executor(processes)(batch[0]) for _ in range(args.workers * 4)))
    ways: list[tuple[str, Callable[[list[dict[str, str]]], Any]]] = [
        ("on the event loop", on_loop()),
        ("1 worker thread (berth serve)", on_executor(threads[1])),
        (f"{args.workers} worker threads", on_executor(threads[args.workers])),
        (f"{args.workers} worker processes", on_executor(processes)),
    ]
    rounds: dict[str, list[Result]] = {name: [] for name, _ in ways}
    for round_index in range(args.rounds):
        # Alternate the order, so that the machine's drift hits every way alike.
        order = ways if round_index % 2 == 0 else list(reversed(ways))
        for name, submit in order:
            rounds[name].append(await run_burst(name, submit, batch))
    for pool in (*threads.values(), processes):
        pool.shutdown()
    return [
        Result(
            name,
            statistics.median(r.requests_per_s for r in results),
            statistics.median(r.worst_stall_ms for r in results),
            results[0].tokens,
        )
        for name, results in rounds.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin://smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=64, help="requests in each burst")
    parser.add_argument("--long-every", type=int, default=8, help="one long document per N")
    parser.add_argument("--long-words", type=int, default=800, help="words in a long document")
    parser.add_argument("--workers", type=int, default=2, help="threads / processes to compare")
    parser.add_argument("--rounds", type=int, default=3, help="bursts per way (median reported)")
    args = parser.parse_args(argv)
    model_path = resolve_model(args.model).path
    results = asyncio.run(compare(str(model_path), args))
    base = results[1].requests_per_s
    print(
        f"\n{args.requests} concurrent chat requests, one of each {args.long_every} a "
        f"{args.long_words}-word document ({results[0].tokens:,} prompt tokens); "
        f"median of {args.rounds} bursts\n"
    )
    print("| Where templating and tokenizing run | Requests/s | vs 1 thread | Longest loop stall |")
    print("|---|---|---|---|")
    for r in results:
        print(
            f"| {r.name} | {r.requests_per_s:,.0f} | {r.requests_per_s / base:.2f}x | "
            f"{r.worst_stall_ms:,.1f} ms |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
