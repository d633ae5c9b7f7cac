"""A decode step's layers in one C++ call (`torch.ops.berth.decode_layers`): bit for bit the
Python layers' result and K/V, at every batch size it takes, and off where it does not apply."""

from __future__ import annotations

import pytest
import torch

from berth_runtime.model_executor.forward_batch import ForwardBatch
from berth_runtime.models.gguf_q4 import can_run_int4
from tests.helpers import REDUCED_DTYPE
from tests.integration.runtime.engine_steps import load_runner, prefill

MAX_BATCH = 4

# In bf16 (fp32 on AVX2, where only Berth's int8 kernel runs the 4-bit weights).
pytestmark = pytest.mark.skipif(
    REDUCED_DTYPE == "bfloat16" and not can_run_int4(torch.bfloat16, torch.device("cpu")),
    reason="this PyTorch build has no CPU int4 kernel",
)


@pytest.fixture(scope="module")
def runner():
    return load_runner(dtype=REDUCED_DTYPE, max_total_tokens=2048, gguf_q4_max_batch=MAX_BATCH)


@pytest.mark.parametrize("batch_size", [1, 3, MAX_BATCH])
def test_fused_decode_equals_the_python_layers(runner, batch_size):
    """Each decode step runs both ways on the same cache: the same hidden states and the same
    K/V written, bit for bit, over several steps of ragged sequences."""
    model = runner.model
    assert runner.fused_decode and model.fused_decode_rows == MAX_BATCH
    runner.kv_pool.clear()
    prompts = [[5 + (7 * i + j) % 900 for j in range(9 + 6 * i)] for i in range(batch_size)]
    lens, logits = prefill(runner, prompts)
    feed = logits.argmax(-1).tolist()
    table = runner.req_to_token_pool.req_to_token
    rows = list(range(1, batch_size + 1))
    for _ in range(4):
        slots = runner.kv_pool.alloc(batch_size)
        table[torch.tensor(rows), torch.tensor(lens)] = slots
        batch = ForwardBatch.decode(feed, lens, slots, rows, table, runner.device)
        fused = runner.forward(batch)
        fused_kv = runner.kv_pool.kv_buffer[:, slots].clone()
        runner.kv_pool.kv_buffer[:, slots] = 0
        model.fused_decode_rows = 0  # the Python layers, on the same inputs
        try:
            plain = runner.forward(batch)
        finally:
            model.fused_decode_rows = MAX_BATCH
        assert torch.equal(fused, plain)
        assert torch.equal(runner.kv_pool.kv_buffer[:, slots], fused_kv)
        feed = runner.compute_logits(fused).argmax(-1).tolist()
        lens = [n + 1 for n in lens]


def test_larger_steps_and_bf16_only_models_keep_the_python_layers():
    bf16 = load_runner(dtype=REDUCED_DTYPE, max_total_tokens=256, gguf_q4_max_batch=0)
    assert not bf16.fused_decode and bf16.model.fused_decode_rows == 0
    native = load_runner(
        dtype=REDUCED_DTYPE,
        max_total_tokens=256,
        gguf_q4_max_batch=2,
        attention_backend="torch_native",
    )
    assert not native.fused_decode and native.model.fused_decode_rows == 0


def test_bad_weights_are_a_clear_error(runner):
    model = runner.model
    with pytest.raises(RuntimeError, match="expected 301 weights, got 300"):
        torch.ops.berth.decode_layers(
            torch.zeros(1, 576, dtype=torch.bfloat16),
            torch.zeros(1, 1, 64, dtype=torch.bfloat16),
            torch.zeros(1, 1, 64, dtype=torch.bfloat16),
            runner.kv_pool.kv_buffer,
            torch.ones(1, dtype=torch.int64),
            torch.ones(1, 1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int64),
            model.fused_decode_weights[:-1],
            9,
            3,
            1536,
            1e-5,
            0.125,
        )
