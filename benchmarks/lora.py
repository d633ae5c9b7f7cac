"""What serving LoRA adapters costs: decode tokens/s with every request on the base model, against
the same load spread over 4 adapters (rank 16 on every projection), at 8 and 32 concurrent streams.

    python -m benchmarks.lora        # or: make bench-lora

One `berth serve --enable-lora` of the embedded model in its default dtype holds the adapters
(random weights, written in PEFT's format); the two loads run on it one after the other, each
stream a chat request of 128 tokens (ignore_eos), and tokens/s is completion tokens over the wall
time of the whole load. The goal (issue 39): at least 0.7x the base's tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from berth_common.server_process import berth_server
from berth_runtime.models.loader import resolve_model

ADAPTERS = 4
RANK = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_TOKENS = 128


def write_adapter(path: Path, config, seed: int) -> None:
    """A PEFT LoRA adapter directory with small random weights on every projection."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = hidden // config.num_attention_heads
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
    adapter_config = {"peft_type": "LORA", "r": RANK, "lora_alpha": RANK, "target_modules": TARGETS}
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

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        start = time.perf_counter()
        tokens = await asyncio.gather(
            *(one(client, models[i % len(models)]) for i in range(streams))
        )
        return sum(tokens) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    args = parser.parse_args()
    model_dir = resolve_model("builtin://smollm2-135m-instruct").path
    config = AutoConfig.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i in range(ADAPTERS):
            write_adapter(Path(tmp) / f"a{i}", config, seed=i)
            paths.append(f"a{i}={Path(tmp) / f'a{i}'}")
        server = berth_server(
            "serve",
            "--model",
            model_dir,
            "--served-model-name",
            "base",
            "--lora-paths",
            *paths,
            "--max-running-requests",
            str(max(args.streams)),
        ).wait_ready()
        try:
            info = httpx.get(f"{server.base_url}/get_server_info").json()
            dtype = info.get("engine", info).get("dtype")
            print(f"dtype {dtype}, {ADAPTERS} adapters of rank {RANK}, all projections")
            print(f"{'streams':>8} {'base tok/s':>11} {'4 adapters':>11} {'ratio':>6}")
            asyncio.run(load(server.base_url, ["base"], 4))  # warm up
            for streams in args.streams:
                base = asyncio.run(load(server.base_url, ["base"], streams))
                names = [f"a{i}" for i in range(ADAPTERS)]
                lora = asyncio.run(load(server.base_url, names, streams))
                print(f"{streams:>8} {base:>11.1f} {lora:>11.1f} {lora / base:>5.2f}x")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
