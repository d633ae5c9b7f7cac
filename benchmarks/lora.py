"""What serving LoRA adapters costs: decode tokens/s with every request on the base model, against
the same load spread over 4 adapters (rank 16 on every projection), at 8 and 32 concurrent streams.

    python -m benchmarks.lora        # or: make bench-lora

Two models, each served by one `berth serve --enable-lora` in its default dtype: the embedded
SmolLM2-135M (its own weights), and a model of Llama 3.2 1B's shape with random weights
(`--load-format dummy`: 16 layers, hidden 2048). The adapters have random weights, written in
PEFT's format. On each server the two loads alternate, three rounds (the median of each is
shown); each stream is a chat request of 128 tokens (ignore_eos), and tokens/s is completion
tokens over the load's wall time.
The goal (issue 39): at least 0.7x the base's tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from berth_common.server_process import berth_server
from berth_runtime.models.dummy_weights import write_dummy_model_dir
from berth_runtime.models.loader import resolve_model

ADAPTERS = 4
RANK = 16
MAX_TOKENS = 128
LLAMA_1B_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_adapter(path: Path, config, seed: int) -> None:
    """A PEFT LoRA adapter directory with small random weights on every projection."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for target, (fan_in, fan_out) in shapes.items():
            owner = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{owner}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=generator)
    path.mkdir(parents=True)
    save_file({k: v * 0.01 for k, v in tensors.items()}, path / "adapter_model.safetensors")
    adapter_config = {"peft_type": "LORA", "r": RANK, "lora_alpha": RANK, "target_modules": []}
    (path / "adapter_config.json").write_text(json.dumps(adapter_config))


async def load(base_url: str, models: list[str], streams: int) -> float:
    """Decode tokens/s of `streams` concurrent requests, request i on models[i % len(models)]."""

    async def one(client: httpx.AsyncClient, model: str) -> int:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
        }
        response = await client.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(base_url=base_url, timeout=900) as client:
        start = time.perf_counter()
        jobs = (one(client, models[i % len(models)]) for i in range(streams))
        tokens = await asyncio.gather(*jobs)
        return sum(tokens) / (time.perf_counter() - start)


def measure(model_dir: Path, extra: list[str], label: str, args: argparse.Namespace) -> None:
    config = AutoConfig.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory(prefix="berth-bench-lora-") as tmp:
        paths = []
        for i in range(ADAPTERS):
            write_adapter(Path(tmp) / f"a{i}", config, seed=i)
            paths.append(f"a{i}={Path(tmp) / f'a{i}'}")
        server = berth_server(
            "serve",
            "--model",
            str(model_dir),
            "--served-model-name",
            "base",
            "--lora-paths",
            *paths,
            "--max-running-requests",
            str(max(args.streams)),
            "--max-loras-per-batch",
            str(args.max_loras_per_batch),
            *extra,
        ).wait_ready(timeout=600)
        try:
            info = httpx.get(f"{server.base_url}/get_server_info").json()
            dtype = info.get("engine", info).get("dtype")
            print(f"\n{label}, {dtype}: base vs {ADAPTERS} adapters of rank {RANK} on every ")
            print(f"projection, --max-loras-per-batch {args.max_loras_per_batch}")
            print(f"{'streams':>8} {'base tok/s':>11} {'4 adapters':>11} {'ratio':>6}")
            asyncio.run(load(server.base_url, ["base"], 4))  # warm up
            names = [f"a{i}" for i in range(ADAPTERS)]
            for streams in args.streams:
                bases, loras = [], []
                for _ in range(args.rounds):  # interleaved: a noisy neighbour hits both
                    bases.append(asyncio.run(load(server.base_url, ["base"], streams)))
                    loras.append(asyncio.run(load(server.base_url, names, streams)))
                base, lora = statistics.median(bases), statistics.median(loras)
                print(f"{streams:>8} {base:>11.1f} {lora:>11.1f} {lora / base:>5.2f}x", flush=True)
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--max-loras-per-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="each load's median of this many")
    args = parser.parse_args()
    embedded = Path(resolve_model("builtin://smollm2-135m-instruct").path)
    measure(embedded, [], "SmolLM2-135M (embedded)", args)
    with tempfile.TemporaryDirectory(prefix="berth-bench-lora-1b-") as tmp:
        vocab = AutoConfig.from_pretrained(embedded).vocab_size
        shape = {**LLAMA_1B_SHAPE, "vocab_size": vocab}
        model = write_dummy_model_dir(Path(tmp) / "llama-1b-shape", shape, embedded)
        measure(model, ["--load-format", "dummy"], "Llama 3.2 1B's shape (random weights)", args)


if __name__ == "__main__":
    main()
