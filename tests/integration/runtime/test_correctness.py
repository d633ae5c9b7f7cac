"""Greedy output equals Hugging Face transformers token for token, alone and under concurrency."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.helpers import BUILTIN_GGUF, embedded_gguf_dir, embedded_tokenizer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
]
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model():
    """transformers' own Llama, loaded from the same GGUF file the server serves."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(embedded_gguf_dir()), gguf_file=BUILTIN_GGUF, dtype=torch.float32
    )
    return model.eval()


def hf_greedy(model, input_ids: list[int], num_tokens: int) -> list[int]:
    """Plain argmax decoding with the KV cache, ignoring EOS (no logits processors)."""
    out: list[int] = []
    with torch.inference_mode():
        result = model(torch.tensor([input_ids]), use_cache=True)
        past = result.past_key_values
        for _ in range(num_tokens):
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            result = model(torch.tensor([[token]]), cache=past, use_cache=True)
            past = result.past_key_values
    return out


def server_greedy(base_url: str, input_ids: list[int], num_tokens: int) -> list[int]:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": num_tokens, "temperature": 0, "ignore_eos": True},
    }
    resp = httpx.post(f"{base_url}/generate", json=body, timeout=300)
    resp.raise_for_status()
    return resp.json()["output_ids"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers(server, hf_model, prompt):
    ids = embedded_tokenizer()(prompt).input_ids
    expected = hf_greedy(hf_model, ids, NUM_TOKENS)
    assert server_greedy(server.base_url, ids, NUM_TOKENS) == expected


def test_sixteen_concurrent_requests_equal_each_alone(server):
    tok = embedded_tokenizer()
    prompts = [f"Write a sentence about the number {i}." for i in range(16)]
    inputs = [tok(p).input_ids for p in prompts]
    alone = [server_greedy(server.base_url, ids, 24) for ids in inputs]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda ids: server_greedy(server.base_url, ids, 24), inputs))
    assert together == alone
