"""The fused MoE kernel (`berth_runtime.kernels.triton_moe`) without a GPU: run through Triton's
interpreter against the grouped path (`SparseMoE` on CPU) and an fp64 reference, for decode and
prefill token counts, padding in every block; the alignment's shapes fixed by the token count;
and a build for CUDA targets that checks what the interpreter cannot."""

from __future__ import annotations

import pytest
import torch

from berth_runtime.kernels import triton_moe as tm
from berth_runtime.models.layers.mlp import gated
from berth_runtime.models.layers.moe import SparseMoE
from tests.triton_worker import build_for_cuda, interpreted

pytestmark = pytest.mark.skipif(tm.triton is None, reason="Triton is not installed")

# (tokens, experts, top-k, hidden, expert intermediate): one decode token; a few; a prefill with
# experts of many tokens (runs past one block); more experts than pairs; K not a block multiple.
SHAPES = [(1, 8, 2, 128, 64), (5, 8, 2, 128, 64), (40, 4, 2, 96, 80), (7, 16, 4, 64, 48)]


def random_moe(experts: int, top_k: int, hidden: int, inner: int, dtype: torch.dtype):
    torch.manual_seed(experts * 100 + hidden)
    moe = SparseMoE(hidden, inner, experts, top_k, normalize_top_k=True)
    with torch.no_grad():
        for parameter in moe.parameters():
            parameter.normal_(0, 0.2)
    return moe.to(dtype)


def reference(moe: SparseMoE, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor):
    """In fp64, token by token, the given routing."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    gate_up, down = moe.experts_gate_up.double(), moe.experts_down.double()
    for token in range(x.shape[0]):
        for expert, weight in zip(experts[token].tolist(), weights[token].double()):
            projected = gate_up[expert] @ x[token].double()
            gate, up = projected.chunk(2)
            out[token] += weight * (down[expert] @ gated(gate, up, "silu"))
    return out


@interpreted
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_experts_equal_the_grouped_path_in_fp32(shape) -> None:
    tokens, experts, top_k, hidden, inner = shape
    moe = random_moe(experts, top_k, hidden, inner, torch.float32)
    x = torch.randn(tokens, hidden)
    chosen, weights = moe.route(x, 0)
    fused = tm.fused_experts(x, moe.experts_gate_up, moe.experts_down, chosen, weights, "silu")
    torch.testing.assert_close(fused, moe(x, 0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        fused.double(), reference(moe, x, chosen, weights), rtol=1e-5, atol=1e-5
    )


@interpreted
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_experts_in_bf16_are_as_close_to_fp64_as_the_grouped_path(shape) -> None:
    """One rounding per projection (fp32 accumulators, the routing weight applied before it)
    instead of the grouped path's several: no worse, on the worst and the mean element."""
    tokens, experts, top_k, hidden, inner = shape
    moe = random_moe(experts, top_k, hidden, inner, torch.bfloat16)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    chosen, weights = moe.route(x, 0)
    exact = reference(moe, x, chosen, weights)
    fused = tm.fused_experts(x, moe.experts_gate_up, moe.experts_down, chosen, weights, "silu")
    ours, grouped = (fused.double() - exact).abs(), (moe(x, 0).double() - exact).abs()
    assert ours.max() <= grouped.max() and ours.mean() <= grouped.mean(), (
        ours.max(),
        grouped.max(),
    )


def test_the_alignment_sorts_pairs_by_expert_in_padded_blocks_of_one_expert() -> None:
    torch.manual_seed(0)
    experts = torch.randint(0, 6, (9, 2))
    sorted_pairs, block_experts, padded = tm.align_by_expert(experts, 6, block_m=4)
    num_pairs = experts.numel()
    # Shapes depend on the pair count only (what a CUDA graph needs), whatever the routing.
    assert sorted_pairs.shape == (num_pairs + 6 * 3,) and block_experts.shape == (9,)
    length = int(padded)
    assert length % 4 == 0 and (sorted_pairs[length:] == num_pairs).all()
    real = sorted_pairs[:length]
    assert sorted(real[real < num_pairs].tolist()) == list(range(num_pairs))  # each pair once
    flat = experts.view(-1)
    for block in range(length // 4):
        pairs = real[block * 4 : block * 4 + 4]
        pairs = pairs[pairs < num_pairs]
        assert len(pairs) > 0 and (flat[pairs] == block_experts[block]).all()


@pytest.mark.parametrize(
    ("dtype", "arch"), [(torch.bfloat16, 90), (torch.bfloat16, 80), (torch.float16, 90)]
)
def test_the_kernel_builds_for_cuda(dtype, arch, monkeypatch) -> None:
    """What the interpreter cannot check: the kernel lowers for the GPU (tensor-core MMA) within
    the shared memory of the smallest target."""
    if tm.library_interpreted():
        pytest.skip("this process imported Triton for the interpreter")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    moe = random_moe(128, 8, 2048, 768, dtype)  # Qwen3-30B-A3B's expert shapes
    experts = torch.randint(0, 128, (4, 8))
    alignment = tm.align_by_expert(experts, 128)
    x = torch.randn(4, 2048, dtype=dtype)
    for weight, a, top_k, pair_weights in (
        (moe.experts_gate_up, x, 8, None),
        (moe.experts_down, torch.randn(32, 768, dtype=dtype), 1, torch.rand(32, dtype=dtype)),
    ):
        _, args, kwargs = tm.launch_arguments(a, weight, alignment, top_k, pair_weights, False)
        compiled = build_for_cuda(tm.kernel(interpret=False), args, kwargs, arch)
        assert compiled.metadata.shared <= 100 * 1024
        assert "mma" in compiled.asm["ptx"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu() -> None:
    """The same checks on the GPU at hand, and a CUDA graph of the whole layer: captured once,
    replayed with other inputs and routing, equal to running it eagerly (capture fails on a
    host sync)."""
    if tm.library_interpreted():
        pytest.skip("this process imported Triton for the interpreter")
    for tokens, experts, top_k, hidden, inner in SHAPES:
        moe = random_moe(experts, top_k, hidden, inner, torch.float32).cuda()
        x = torch.randn(tokens, hidden, device="cuda")
        chosen, weights = moe.route(x, 0)
        fused = tm.fused_experts(x, moe.experts_gate_up, moe.experts_down, chosen, weights, "silu")
        exact = reference(moe.cpu(), x.cpu(), chosen.cpu(), weights.cpu())
        torch.testing.assert_close(fused.cpu().double(), exact, rtol=1e-4, atol=1e-4)
    moe = random_moe(8, 2, 128, 64, torch.bfloat16).cuda()
    moe.use_fused()
    x = torch.randn(4, 128, dtype=torch.bfloat16, device="cuda")
    moe(x, 4)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe(x, 4)
    x.copy_(torch.randn(4, 128, dtype=torch.bfloat16, device="cuda"))
    graph.replay()
    torch.testing.assert_close(captured, moe(x, 4), rtol=0, atol=0)
