"""The CPU bf16 path (`--dtype auto` on CPUs with native bf16): oneDNN-prepacked projection weights
give the same numbers as plain bf16 weights, batch 1 (matrix-vector path) and ragged batches alike,
and greedy decoding stays on the fp32 model's track."""

from __future__ import annotations

import pytest
import torch

from berth_runtime.model_executor import model_runner
from berth_runtime.model_executor.model_runner import ModelRunner, cpu_has_native_bf16
from berth_runtime.models.layers.linear import can_prepack_cpu_linears, pack_weight, packed_linear
from tests.helpers import embedded_tokenizer, needs_bf16
from tests.integration.runtime.engine_steps import greedy_run, load_runner

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
STEPS = 12


def test_auto_dtype_follows_the_cpu():
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert model_runner.resolve_dtype("auto", torch.device("cpu")) is expected
    assert model_runner.resolve_dtype("float32", torch.device("cpu")) is torch.float32


def load(dtype: str) -> ModelRunner:
    return load_runner(dtype=dtype, max_total_tokens=512, gguf_q4_max_batch=0)


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    tokenizer = embedded_tokenizer()
    return [tokenizer.encode(p) for p in PROMPTS]


@needs_bf16
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


@needs_bf16
def test_bf16_greedy_starts_like_fp32(prompt_ids):
    _, bf16_tokens = greedy_run(load("bfloat16"), prompt_ids, 3)
    _, fp32_tokens = greedy_run(load("float32"), prompt_ids, 3)
    assert [seq[:2] for seq in bf16_tokens] == [seq[:2] for seq in fp32_tokens]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (576, 1536), (49152, 576)])
def test_a_packed_projections_row_does_not_depend_on_the_rows_beside_it(
    dtype, out_features, in_features
):
    """Every step size from 1 to 100 rows gives each row the bits it gets alone (on a CPU with
    AMX, oneDNN rounds bf16 steps of over 32 rows differently: `row_block` splits them)."""
    if not can_prepack_cpu_linears(dtype, torch.device("cpu")):
        pytest.skip(f"oneDNN prepacking of {dtype} is not available on this CPU")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    packed = pack_weight(weight)
    x = torch.randn(100, in_features, generator=gen).to(dtype)
    alone = torch.cat([packed_linear(x[i : i + 1], packed) for i in range(100)])
    for rows in (2, 7, 32, 33, 64, 65, 100):
        assert torch.equal(packed_linear(x[:rows], packed), alone[:rows]), rows
