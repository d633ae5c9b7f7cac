"""LoRA updates on Triton (`LoraPool` with `triton=True`: `triton_moe`'s grouped matmul, a slot
for an expert) through Triton's interpreter, against the CPU path's stacked matmuls: base rows
and empty slots included, decode and prefill row counts, in fp32."""

from __future__ import annotations

import pytest
import torch

from berth_runtime.kernels import triton_moe
from berth_runtime.lora.adapter import LoraAdapter, ProjectionDelta
from berth_runtime.lora.pool import LoraPool
from tests.triton_worker import interpreted

pytestmark = pytest.mark.skipif(triton_moe.triton is None, reason="Triton is not installed")

SLOTS, MAX_RANK = 3, 8
SHAPES = {(0, "qkv_proj"): (64, 96), (0, "down_proj"): (80, 64), (1, "o_proj"): (64, 64)}
PARTS = {"qkv_proj": 3, "down_proj": 1, "o_proj": 1}


def adapter(name: str, rank: int, seed: int) -> LoraAdapter:
    """Random updates of every shape (rank `rank`; the MLP's skipped by one adapter)."""
    generator = torch.Generator().manual_seed(seed)
    made = LoraAdapter(name, f"/{name}", rank)
    for key, (fan_in, fan_out) in SHAPES.items():
        if name == "b" and key[1] == "down_proj":
            continue  # an adapter that leaves a projection alone
        width = PARTS[key[1]] * rank
        made.deltas[key] = ProjectionDelta(
            torch.randn(width, fan_in, generator=generator),
            torch.randn(fan_out, width, generator=generator),
        )
    return made


def pools() -> tuple[LoraPool, LoraPool]:
    made = []
    for triton in (False, True):
        pool = LoraPool(SLOTS, MAX_RANK, torch.device("cpu"), torch.float32, False, triton)
        pool.shapes.update(SHAPES)
        for index, name in enumerate(("a", "b")):
            pool.fill(adapter(name, rank=8 - 4 * index, seed=index), set())
        made.append(pool)
    return made[0], made[1]


@interpreted
@pytest.mark.parametrize(
    "adapters, rows",
    [
        (["a", None, "b", "a"], [1, 1, 1, 1]),  # a decode step: base rows between adapters
        (["b", "a", None], [7, 20, 5]),  # a prefill: runs longer than a block
        (["a"], [1]),
    ],
)
def test_triton_updates_equal_the_stacked_matmuls(adapters, rows) -> None:
    torch_pool, triton_pool = pools()
    total = sum(rows)
    for key, (fan_in, fan_out) in SHAPES.items():
        x = torch.randn(total, fan_in)
        base = torch.randn(total, fan_out)
        outs = []
        for pool in (torch_pool, triton_pool):
            pool.set_batch(adapters, rows)
            out = base.clone()
            pool.add_delta(key[0], key[1], x, out)
            outs.append(out)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-4)
        # Base rows are left exactly as they were.
        start = 0
        for name, count in zip(adapters, rows):
            if name is None:
                assert torch.equal(outs[1][start : start + count], base[start : start + count])
            start += count
