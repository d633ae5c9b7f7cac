"""What "same question, same answer" costs (issue 21): each part of the design against the behaviour
it replaced, side by side in one run where the code keeps a switch for the old behaviour, and as
an absolute figure where it does not.

    python -m benchmarks.same_answer        # or: make bench-same-answer

On the embedded model in bf16, through the engine itself (a ModelRunner, no server):

- Prefill attention: `berth_cpu` computes every prompt token alone over its own K/V, so caching
  and chunking cannot change it; before, prefill ran PyTorch's SDPA, which
  `--attention-backend torch_native` still does. Prompts prefilled in chunks of 512 tokens, as
  `berth serve` does; rounds alternate which backend goes first.
- Exact top logits: each row's 32 leading candidates recomputed with an fp32 result, against the
  bf16 lm_head alone (what ran before), with the greedy max after both; the whole decode step of
  the same batch is shown for scale.
- A one-token extend after a cached prompt runs on the bf16 weights; before, a step of at most
  `--gguf-q4-max-batch` tokens ran on the GGUF's 4-bit weights, as a one-sequence decode step
  still does.
- A single row through oneDNN runs as two (its one-row kernel rounds differently): every
  projection of the model on one row, both ways.
- A conversation's next turn computes its previous answer again (K/V that decode steps wrote on
  the 4-bit weights are not cached). No switch keeps them: the extend of the answer and the new
  message is timed against that of the new message alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from berth_runtime.model_executor.forward_batch import ForwardBatch
from berth_runtime.model_executor.model_runner import ModelRunner, cpu_has_native_bf16
from berth_runtime.models.layers.linear import _linear_pointwise, packed_linear
from berth_runtime.models.loader import resolve_model
from berth_runtime.server_args import ServerArgs

CHUNK = ServerArgs().chunked_prefill_size
DECODE_CONTEXT = 64  # tokens each sequence holds before the timed decode steps
REPEATS = 30  # micro-timings: median over this many, old and new interleaved


@dataclass(frozen=True)
class Row:
    what: str
    now: float  # seconds
    before: float  # seconds: the old behaviour, or what stands for it where there is no switch
    how: str  # what "before" is


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.2f} ms" if seconds < 1 else f"{seconds:,.2f} s"


def load(path: str, dtype: str, **settings) -> ModelRunner:
    return ModelRunner(path, ServerArgs(dtype=dtype, max_total_tokens=16384, **settings))


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=g).tolist()


def extend(runner: ModelRunner, rows: list[int], ids: list[list[int]], starts: list[int]):
    """One extend step: `ids[b]` new tokens of sequence `rows[b]` after its `starts[b]` cached
    ones; returns the batch and its last tokens' hidden states."""
    table = runner.req_to_token_pool.req_to_token
    lens = [len(x) for x in ids]
    slots = runner.kv_pool.alloc(sum(lens))
    offset = 0
    for row, start, n in zip(rows, starts, lens):
        table[row, start : start + n] = slots[offset : offset + n]
        offset += n
    flat = [t for x in ids for t in x]
    batch = ForwardBatch.extend(flat, starts, lens, slots, rows, table, runner.device)
    hidden = runner.forward(batch)
    return batch, hidden[batch.last_token_index]


def prefill_seconds(runner: ModelRunner, ids: list[int]) -> float:
    """A whole prompt in chunks of CHUNK tokens, each with its last token's logits."""
    runner.kv_pool.clear()
    started = time.perf_counter()
    for start in range(0, len(ids), CHUNK):
        _, last = extend(runner, [1], [ids[start : start + CHUNK]], [start])
        runner.compute_logits(last)
    return time.perf_counter() - started


def median_seconds(fn: Callable[[], object]) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def interleaved(old: Callable[[], object], new: Callable[[], object]) -> tuple[float, float]:
    """Median seconds of `old` and `new`, called in turn REPEATS times after one warm-up each."""
    old(), new()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(REPEATS):
        for fn, out in ((old, times[0]), (new, times[1])):
            started = time.perf_counter()
            fn()
            out.append(time.perf_counter() - started)
    return statistics.median(times[0]), statistics.median(times[1])


def bench_prefill(path: str, dtype: str, lengths: list[int], rounds: int) -> list[Row]:
    runners = {
        "berth_cpu": load(path, dtype, attention_backend="berth_cpu"),
        "torch_native": load(path, dtype, attention_backend="torch_native"),
    }
    vocab = runners["berth_cpu"].vocab_size
    for runner in runners.values():  # warm-up: first calls pay for lazy initialisation
        prefill_seconds(runner, tokens(CHUNK + 16, vocab, 0))
    rows = []
    for n in lengths:
        ids = tokens(n, vocab, n)
        got: dict[str, list[float]] = {name: [] for name in runners}
        for r in range(rounds):
            order = list(runners) if r % 2 == 0 else list(reversed(runners))
            for name in order:
                got[name].append(prefill_seconds(runners[name], ids))
        rows.append(
            Row(
                f"Prefill of a {n:,}-token prompt (attention per token)",
                statistics.median(got["berth_cpu"]),
                statistics.median(got["torch_native"]),
                "SDPA (`--attention-backend torch_native`)",
            )
        )
    return rows


def bench_steps(path: str, dtype: str, batches: list[int]) -> list[Row]:
    runner = load(path, dtype)  # the defaults: berth_cpu, 4-bit decode steps
    model = runner.model
    vocab = runner.vocab_size
    table = runner.req_to_token_pool.req_to_token
    rows = []

    for size in batches:  # exact top logits, next to the decode step they follow
        runner.kv_pool.clear()
        seqs = list(range(1, size + 1))
        prompts = [tokens(DECODE_CONTEXT, vocab, 1000 + b) for b in seqs]
        extend(runner, seqs, prompts, [0] * size)
        lens = [DECODE_CONTEXT] * size
        slots = runner.kv_pool.alloc(size)
        table[torch.tensor(seqs), torch.tensor(lens)] = slots
        feed = [p[-1] for p in prompts]

        def step(feed=feed, lens=lens, slots=slots, seqs=seqs) -> torch.Tensor:
            batch = ForwardBatch.decode(feed, lens, slots, seqs, table, runner.device)
            return runner.forward(batch)

        hidden = step()
        weight = model.lm_head_weight()

        def bf16_lm_head(hidden=hidden, weight=weight) -> object:
            head = model.packed_lm_head if model.packed_lm_head is not None else weight
            with torch.inference_mode():
                return packed_linear(hidden, head).max(dim=-1).indices

        def exact(hidden=hidden) -> object:
            return model.compute_logits(hidden).max(dim=-1).indices

        before, now = interleaved(bf16_lm_head, exact)
        decode_step = median_seconds(step)
        rows.append(
            Row(
                f"Logits + greedy pick, batch {size} (decode step: {ms(decode_step)})",
                now,
                before,
                "the bf16 lm_head alone",
            )
        )

    # A one-token extend after a cached prompt (bf16 weights) vs the old path's 4-bit step.
    runner.kv_pool.clear()
    prompt = tokens(DECODE_CONTEXT + 1, vocab, 7)
    extend(runner, [1], [prompt[:-1]], [0])
    slot = runner.kv_pool.alloc(1)
    table[1, DECODE_CONTEXT] = slot

    def one_token_extend() -> object:
        batch = ForwardBatch.extend(
            prompt[-1:], [DECODE_CONTEXT], [1], slot, [1], table, runner.device
        )
        return runner.forward(batch)

    def one_token_4bit() -> object:
        batch = ForwardBatch.decode(prompt[-1:], [DECODE_CONTEXT], slot, [1], table, runner.device)
        return runner.forward(batch)

    if runner.q4_bytes:
        before, now = interleaved(one_token_4bit, one_token_extend)
        rows.append(
            Row(
                "One-token extend after a cached prompt (bf16 weights)",
                now,
                before,
                "the 4-bit weights (`--gguf-q4-max-batch 8`)",
            )
        )

    # Every projection of a one-row step: one row run as two through oneDNN, vs one row alone
    # (prepacked weights, or, where the 4-bit weights are the only copy, their bf16 dequantized).
    packed = [
        (m, m.weight if m.weight is not None else m.berth_int4.dequantized(m.berth_scratch).clone())
        for m in model.modules()
        if getattr(m, "berth_packed", False) or getattr(m, "berth_scratch", None) is not None
    ]
    if packed:
        xs = [torch.randn(1, m.in_features, dtype=runner.dtype) for m, _ in packed]

        def as_one() -> None:
            for (_, w), x in zip(packed, xs):
                _linear_pointwise(x, w)

        def as_two() -> None:
            for (_, w), x in zip(packed, xs):
                packed_linear(x, w)

        before, now = interleaved(as_one, as_two)
        rows.append(
            Row(
                f"All {len(packed)} projections of one row (run as two rows)",
                now,
                before,
                "one row alone (oneDNN's one-row kernel)",
            )
        )

    # The next turn: a 24-token message after a 48-token turn and its 64-token answer.
    runner.kv_pool.clear()
    turn, answer, message = (tokens(n, vocab, 50 + n) for n in (48, 64, 24))
    extend(runner, [1, 2], [turn + answer, turn], [0, 0])
    slots_kept = runner.kv_pool.alloc(len(message))
    slots_recomputed = runner.kv_pool.alloc(len(answer) + len(message))
    table[1, 112:136] = slots_kept
    table[2, 48:136] = slots_recomputed

    def kept() -> object:
        batch = ForwardBatch.extend(message, [112], [24], slots_kept, [1], table, runner.device)
        return runner.forward(batch)

    def recomputed() -> object:
        ids = answer + message
        batch = ForwardBatch.extend(ids, [48], [88], slots_recomputed, [2], table, runner.device)
        return runner.forward(batch)

    before, now = interleaved(kept, recomputed)
    rows.append(
        Row(
            "Next turn: extend of a 64-token answer + 24-token message",
            now,
            before,
            "no switch: the 24-token message alone, as if the answer's K/V were cached",
        )
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin://smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=2, help="prefill rounds (median)")
    args = parser.parse_args(argv)

    path = resolve_model(args.model).path
    rows = bench_steps(path, args.dtype, args.batches)
    rows += bench_prefill(path, args.dtype, args.lengths, args.rounds)
    native = "native bf16" if cpu_has_native_bf16() else "no native bf16: bf16 is emulated"
    print(
        f"\n{args.model} in {args.dtype}; {torch.get_num_threads()} threads, {native}; "
        f"prefill in chunks of {CHUNK}, median of {args.rounds} rounds; "
        f"other rows median of {REPEATS}\n"
    )
    print("| What | Same answer (now) | Before | Cost | Before is |")
    print("|---|---|---|---|---|")
    for r in rows:
        diff = r.now - r.before
        cost = f"{'+' if diff >= 0 else '-'}{ms(abs(diff))} ({r.now / r.before:.2f}x)"
        print(f"| {r.what} | {ms(r.now)} | {ms(r.before)} | {cost} | {r.how} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
