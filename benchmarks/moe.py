"""What a mixture-of-experts decode step costs against a dense one with the same active parameters.

    python -m benchmarks.moe        # or: make bench-moe

Three Qwen3-shaped models with random weights (`--load-format dummy`) and the same attention: one
whose MLPs are sparse MoE layers (16 experts of intermediate size I, top-2), one whose MLPs are
dense with intermediate size 2I, the two experts' worth, and a third whose dense MLPs hold as
many parameters as all 16 experts. A decode step of one sequence runs exactly the multiply-adds of
the same-active model; that ratio is what routing and grouping tokens by expert cost. With more
sequences a step touches more experts (up to all 16) and reads more weights, towards the
same-total model's step; there each expert runs on few rows, one oneDNN call after another, and
the per-call cost shows (a fused MoE kernel is what would remove it).
Each row: the median of REPEATS decode steps, the three interleaved, through a ModelRunner
(the engine, no server).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from berth_runtime.model_executor.forward_batch import ForwardBatch
from berth_runtime.model_executor.model_runner import ModelRunner
from berth_runtime.models.dummy_weights import write_dummy_model_dir
from berth_runtime.models.loader import resolve_model
from berth_runtime.server_args import ServerArgs

REPEATS = 40
CONTEXT = 128  # tokens each sequence holds before the timed steps
EXPERTS, TOP_K = 16, 2


def configs(hidden: int, expert_size: int, layers: int) -> dict[str, dict]:
    common = {
        "vocab_size": 49152,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 128,
        "num_key_value_heads": max(1, hidden // 512),
        "head_dim": 128,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return {
        "moe": {
            **common,
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": EXPERTS,
            "num_experts_per_tok": TOP_K,
            "moe_intermediate_size": expert_size,
            "intermediate_size": TOP_K * expert_size,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        "dense": {
            **common,
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "intermediate_size": TOP_K * expert_size,
        },
        "dense_total": {
            **common,
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "intermediate_size": EXPERTS * expert_size,
        },
    }


def decode_step_time(runner: ModelRunner, batch: int) -> callable:
    """A function that runs one decode step of `batch` sequences of CONTEXT tokens (the same
    slots each time: what is timed is the step, not the cache's growth)."""
    table = runner.req_to_token_pool.req_to_token
    rows = list(range(1, batch + 1))
    slots = runner.kv_pool.alloc(batch * (CONTEXT + 1))
    for i, row in enumerate(rows):
        table[row, : CONTEXT + 1] = slots[i * (CONTEXT + 1) : (i + 1) * (CONTEXT + 1)]
    out_loc = torch.stack([table[row, CONTEXT] for row in rows])
    tokens = [100 + i for i in range(batch)]

    def step() -> float:
        start = time.perf_counter()
        decode = ForwardBatch.decode(tokens, [CONTEXT] * batch, out_loc, rows, table, runner.device)
        runner.compute_logits(runner.forward(decode))
        return time.perf_counter() - start

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--expert-size", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args(argv)

    tokenizer = Path(resolve_model("builtin://smollm2-135m-instruct").path)
    runners = {}
    with tempfile.TemporaryDirectory(prefix="berth-bench-moe-") as tmp:
        for name, config in configs(args.hidden, args.expert_size, args.layers).items():
            path = write_dummy_model_dir(Path(tmp) / name, config, tokenizer)
            settings = ServerArgs(
                model=str(path), dtype=args.dtype, load_format="dummy", max_total_tokens=8192
            )
            runners[name] = ModelRunner(str(path), settings)
    mlp = 3 * args.hidden * args.expert_size
    print(
        f"\n{args.layers} layers, hidden {args.hidden}; MoE: {EXPERTS} experts of "
        f"{args.expert_size}, top-{TOP_K} ({TOP_K * mlp / 1e6:.1f}M active of "
        f"{EXPERTS * mlp / 1e6:.1f}M MLP parameters a layer); dense: one MLP of "
        f"{TOP_K * args.expert_size}; {runners['moe'].dtype}, {torch.get_num_threads()} threads, "
        f"median of {REPEATS} steps\n"
    )
    print(
        "| Sequences | MoE step | Dense, same active | Dense, same total | MoE / same active "
        "| MoE / same total |"
    )
    print("|---|---|---|---|---|---|")
    for batch in args.batches:
        steps = {name: decode_step_time(runner, batch) for name, runner in runners.items()}
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(5):  # warm-up
            for step in steps.values():
                step()
        for _ in range(REPEATS):
            for name, step in steps.items():
                times[name].append(step())
        moe, dense, total = (
            statistics.median(times[name]) for name in ("moe", "dense", "dense_total")
        )
        print(
            f"| {batch} | {moe * 1000:.2f} ms | {dense * 1000:.2f} ms | {total * 1000:.2f} ms "
            f"| {moe / dense:.2f}x | {moe / total:.2f}x |"
        )
        for runner in runners.values():
            runner.kv_pool.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
