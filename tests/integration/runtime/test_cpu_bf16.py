"""The CPU bf16 path (`--dtype auto` on CPUs with native bf16): oneDNN-prepacked projection weights
give the same numbers as plain bf16 weights, batch 1 (matrix-vector path) and ragged batches alike,
and greedy decoding stays on the fp32 model's track."""

from __future__ import annotations

import pytest
import torch

from berth_runtime.model_executor import model_runner
from berth_runtime.model_executor.forward_batch import ForwardBatch
from berth_runtime.model_executor.model_runner import ModelRunner, cpu_has_native_bf16
from berth_runtime.models.llama import can_prepack_cpu_linears
from tests.helpers import embedded_model_dir, embedded_tokenizer

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
STEPS = 12


def test_auto_dtype_follows_the_cpu():
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert model_runner.resolve_dtype("auto", torch.device("cpu")) is expected
    assert model_runner.resolve_dtype("float32", torch.device("cpu")) is torch.float32


def greedy_run(runner: ModelRunner, prompts: list[list[int]], steps: int):
    """Prefill every prompt in one batch, then decode them together; returns the prefill logits of
    each prompt's last token and every sequence's greedy tokens."""
    table = runner.req_to_token_pool.req_to_token
    rows = list(range(1, len(prompts) + 1))
    lens = [len(p) for p in prompts]
    slots = runner.kv_pool.alloc(sum(lens))
    offset = 0
    for row, n in zip(rows, lens):
        table[row, :n] = slots[offset : offset + n]
        offset += n
    ids = [t for p in prompts for t in p]
    batch = ForwardBatch.build(ids, [0] * len(prompts), lens, slots, rows, table, runner.device)
    hidden = runner.forward(batch)
    logits = runner.compute_logits(hidden[batch.last_token_index])
    first = logits.clone()
    tokens = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(steps):
        slots = runner.kv_pool.alloc(len(prompts))
        table[torch.tensor(rows), torch.tensor(lens)] = slots
        last = [seq[-1] for seq in tokens]
        ones = [1] * len(prompts)
        batch = ForwardBatch.build(last, lens, ones, slots, rows, table, runner.device)
        logits = runner.compute_logits(runner.forward(batch))
        lens = [n + 1 for n in lens]
        for seq, t in zip(tokens, logits.argmax(-1).tolist()):
            seq.append(t)
    return first, tokens


def load(dtype: str) -> ModelRunner:
    return ModelRunner(embedded_model_dir(), dtype=dtype, max_total_tokens=512)


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    tokenizer = embedded_tokenizer()
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.mark.skipif(
    not can_prepack_cpu_linears(torch.bfloat16, torch.device("cpu")),
    reason="this PyTorch build cannot prepack bf16 weights for oneDNN",
)
def test_prepacked_bf16_equals_plain_bf16(prompt_ids, monkeypatch):
    packed = load("bfloat16")
    assert packed.prepacked
    monkeypatch.setattr(model_runner, "can_prepack_cpu_linears", lambda dtype, device: False)
    plain = load("bfloat16")
    assert not plain.prepacked
    for prompts in ([prompt_ids[0]], prompt_ids):  # batch 1, and a ragged batch of 2
        packed.kv_pool.clear()
        plain.kv_pool.clear()
        packed_logits, packed_tokens = greedy_run(packed, prompts, STEPS)
        plain_logits, plain_tokens = greedy_run(plain, prompts, STEPS)
        torch.testing.assert_close(packed_logits, plain_logits, rtol=0, atol=1e-2)
        assert packed_tokens == plain_tokens


def test_bf16_greedy_starts_like_fp32(prompt_ids):
    _, bf16_tokens = greedy_run(load("bfloat16"), prompt_ids, 3)
    _, fp32_tokens = greedy_run(load("float32"), prompt_ids, 3)
    assert [seq[:2] for seq in bf16_tokens] == [seq[:2] for seq in fp32_tokens]
