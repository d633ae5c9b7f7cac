"""Berth's Triton paged attention kernels (`berth_runtime.kernels.triton_attention`), run on CPU
through Triton's interpreter: the fp64 reference, SDPA's error in bf16/fp16, GQA, ragged
lengths, cached prefixes, scattered slots, padding that is never read, and a token's attention
bit for bit the same in every kind of step. Plus a build of the kernel for CUDA targets (no GPU
needed) that catches what the interpreter cannot: code that does not lower, spills, shared
memory; and the same checks on a real GPU where there is one (marked `gpu`).

The interpreted tests run in the worker process of `tests.triton_worker`.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from berth_runtime.kernels import triton_attention as ta
from tests.integration.runtime.test_cpu_kernels import extend_case, paged_case, reference_attention
from tests.triton_worker import build_for_cuda, interpreted

pytestmark = pytest.mark.skipif(ta.triton is None, reason="Triton is not installed")

# (query heads, KV heads): GQA groups of 1, 3 and 8.
GROUPS = [(4, 4), (9, 3), (16, 2)]
# Invariance cases (dtype, heads, KV heads, head dim), each another block/tile geometry.
INVARIANCE_CASES = [
    (torch.float32, 6, 2, 256),  # K/V tiles of 16 positions, query blocks of 8 tokens
    (torch.bfloat16, 9, 3, 64),  # SmolLM2-135M's shape: tiles of 64, blocks of 8
    (torch.float16, 16, 2, 256),  # tiles of 32, blocks of 4
    (torch.float16, 2, 2, 128),  # tiles of 64, blocks of 32
]


def on(device: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


def sdpa_attention(q, kv, rows, lens, scale):
    """SDPA in q's dtype over K/V gathered into a padded copy, as the torch_native backend does:
    query i attends over the slots rows[i, :lens[i]]."""
    n, heads, dim = q.shape
    kv_heads = kv.shape[1] // 2
    gathered = kv[rows.clamp(max=kv.shape[0] - 2)]  # the padding columns are masked below
    keys = gathered[:, :, :kv_heads].transpose(1, 2)
    values = gathered[:, :, kv_heads:].transpose(1, 2)
    mask = (torch.arange(rows.shape[1])[None] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.view(n, kv_heads, heads // kv_heads, dim), keys, values, attn_mask=mask, scale=scale
    )
    return out.reshape(n, heads, dim)


def check_fp32(heads: int, kv_heads: int, dim: int, device: str = "cpu", tol: float = 2e-6):
    """fp32 decode of ragged lengths 1..45 over scattered slots (padding columns point at a
    poisoned slot), and ragged extends of 1 to 19 tokens after cached prefixes of 0 to 70,
    against the fp64 reference."""
    q, kv, kv_indices, lens = paged_case(6, heads, kv_heads, dim, torch.float32)
    out = ta.decode_attention(*on(device, q, kv, kv_indices, lens), dim**-0.5)
    expected = reference_attention(q, kv, kv_indices, lens, dim**-0.5)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=tol, atol=tol)
    q, kv, kv_indices, seq, lens = extend_case(
        [1, 19, 4, 10], [0, 45, 70, 9], heads, kv_heads, dim, torch.float32
    )
    out = ta.extend_attention(*on(device, q, kv, kv_indices, seq, lens), dim**-0.5)
    expected = reference_attention(q, kv, kv_indices[seq], lens, dim**-0.5)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=tol, atol=tol)


def check_as_close_as_sdpa(dtype: torch.dtype, dim: int, device: str = "cpu", slack: float = 1):
    """Decode (GQA group 3) and extend after prefixes (group 8) in a 16-bit dtype: worst and mean
    error against the fp64 reference no larger than SDPA's in that dtype on the same inputs
    (times `slack`)."""
    scale = dim**-0.5
    q, kv, kv_indices, lens = paged_case(6, 9, 3, dim, dtype, seed=1)
    ours = ta.decode_attention(*on(device, q, kv, kv_indices, lens), scale)
    cases = [(q, kv, kv_indices, lens, ours)]
    q, kv, kv_indices, seq, lens = extend_case([9, 1, 10], [0, 40, 70], 16, 2, dim, dtype)
    ours = ta.extend_attention(*on(device, q, kv, kv_indices, seq, lens), scale)
    cases.append((q, kv, kv_indices[seq], lens, ours))
    for q, kv, rows, lens, ours in cases:
        exact = reference_attention(q, kv, rows, lens, scale)
        our_error = (ours.cpu().double() - exact).abs()
        sdpa_error = (sdpa_attention(q, kv, rows, lens, scale).double() - exact).abs()
        assert our_error.max() <= slack * sdpa_error.max(), (our_error.max(), sdpa_error.max())
        assert our_error.mean() <= sdpa_error.mean(), (our_error.mean(), sdpa_error.mean())


def host_matmul_is_row_invariant() -> bool:
    """Whether this host's numpy matmul, which is what tl.dot runs in the interpreter, gives a
    row the same bits whatever rows come with it. OpenBLAS picks its kernels by shape on some
    CPUs (an AMD EPYC here): there, no kernel run in the interpreter can be bit-for-bit batch
    invariant, however it tiles."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((34, 64), dtype=np.float32)
    b = rng.standard_normal((64, 64), dtype=np.float32)
    return np.array_equal(a @ b, np.vstack([a[:1] @ b, a[1:] @ b]))


def check_invariance(dtype: torch.dtype, heads: int, kv_heads: int, dim: int, device: str = "cpu"):
    """Bit for bit: a token's output is the same extended in one step with its whole sequence,
    in any split of it (on query-block boundaries or not), next to another sequence or alone,
    or decoded alone or in a batch in any order. The second sequence extends a cached prefix
    of 60 across a K/V tile boundary (64 is one for every tile size). On a CPU host whose own
    matmul is not row invariant (see above) the interpreter can only show it to the dtype's
    rounding: equal there means torch.testing.assert_close."""
    exact = device != "cpu" or host_matmul_is_row_invariant()

    def same(got: torch.Tensor, want: torch.Tensor, what: Any) -> None:
        if exact:
            assert torch.equal(got, want), what
        else:
            torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")

    case = extend_case([34, 6], [0, 60], heads, kv_heads, dim, dtype)
    q, kv, kv_indices, seq, lens = on(device, *case)
    scale = dim**-0.5
    whole = ta.extend_attention(q, kv, kv_indices, seq, lens, scale)
    for split in ([1, 33], [13, 20, 1]):
        parts, start = [], 0
        for n in split:
            rows = slice(start, start + n)
            parts.append(
                ta.extend_attention(q[rows], kv, kv_indices[:1], seq[rows], lens[rows], scale)
            )
            start += n
        same(torch.cat(parts), whole[:34], split)
    alone = ta.extend_attention(q[34:], kv, kv_indices[1:], seq[34:] - 1, lens[34:], scale)
    same(alone, whole[34:], "the second sequence alone")
    rows = kv_indices[seq]
    order = torch.randperm(len(seq), generator=torch.Generator().manual_seed(0)).to(device)
    decoded = ta.decode_attention(q[order], kv, rows[order], lens[order], scale)
    same(decoded, whole[order], "decoded, in a shuffled batch")
    one = ta.decode_attention(q[38:39], kv, rows[38:39], lens[38:39], scale)
    same(one, whole[38:39], "decoded alone")


@pytest.mark.parametrize(
    "heads,kv_heads,dim", [(h, kvh, d) for d in (64, 128) for h, kvh in GROUPS] + [(9, 3, 256)]
)
@interpreted
def test_fp32_matches_reference(heads, kv_heads, dim):
    """Decode and extend in fp32 to 2e-6 of the fp64 reference: GQA groups 1, 3, 8, ragged
    lengths from 1, cached prefixes, several K/V tiles (64 positions at dim 64, 32 at 128, 16
    at 256) and query blocks."""
    check_fp32(heads, kv_heads, dim)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 128, 256])
@interpreted
def test_low_precision_is_as_close_as_sdpa(dtype, dim):
    """In bf16 and fp16, decode and extend are as close to the fp64 reference as SDPA in that
    dtype over the same inputs: worst and mean error no larger than SDPA's."""
    check_as_close_as_sdpa(dtype, dim)


@pytest.mark.parametrize("dtype,heads,kv_heads,dim", INVARIANCE_CASES)
@interpreted
def test_a_tokens_attention_is_the_same_in_every_kind_of_step(dtype, heads, kv_heads, dim):
    """Extend whole == any split of it == each token decoded (alone or shuffled), bit for bit."""
    check_invariance(dtype, heads, kv_heads, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@interpreted
def test_padding_slots_are_never_read(dtype):
    """NaN in the padding slot (0) and in the slot the padding columns point at changes nothing,
    bit for bit, in decode or extend: neither is ever loaded."""
    q, kv, kv_indices, lens = paged_case(5, 9, 3, 64, dtype, seed=7)
    eq, ekv, e_indices, seq, elens = extend_case([7, 30], [12, 0], 9, 3, 64, dtype, seed=8)
    clean = (
        ta.decode_attention(q, kv, kv_indices, lens, 0.125),
        ta.extend_attention(eq, ekv, e_indices, seq, elens, 0.125),
    )
    for pool in (kv, ekv):
        pool[0] = float("nan")
        pool[-1] = float("nan")  # the poisoned slot of the padding columns
    poisoned = (
        ta.decode_attention(q, kv, kv_indices, lens, 0.125),
        ta.extend_attention(eq, ekv, e_indices, seq, elens, 0.125),
    )
    for before, after in zip(clean, poisoned):
        assert torch.isfinite(after).all()
        assert torch.equal(after, before)


@interpreted
def test_the_pool_is_read_in_place():
    """A later write to a sequence's slot changes its output and no one else's; q may be a
    strided view (as qkv[:, :H] in the model)."""
    q, kv, kv_indices, lens = paged_case(2, 4, 2, 64, torch.float32, seed=2)
    qkv = torch.cat([q, torch.randn(2, 4, 64)], dim=1)
    before = ta.decode_attention(qkv[:, :4], kv, kv_indices, lens, 0.125)
    assert torch.equal(before, ta.decode_attention(q, kv, kv_indices, lens, 0.125))
    kv[kv_indices[1, 0]] += 3.0
    after = ta.decode_attention(q, kv, kv_indices, lens, 0.125)
    assert torch.equal(after[0], before[0])
    assert not torch.allclose(after[1], before[1])


def test_rejects_bad_input(monkeypatch):
    """The CPU kernels' checks (as ValueError), and a clear error where the interpreter is off
    or was switched on too late; in this process (no kernel runs)."""
    q, kv, kv_indices, lens = paged_case(2, 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="dtypes differ"):
        ta.decode_attention(q.bfloat16(), kv, kv_indices, lens, 0.1)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        ta.decode_attention(q.double(), kv.double(), kv_indices, lens, 0.1)
    with pytest.raises(ValueError, match="head dim"):
        ta.decode_attention(q[..., :48], kv[..., :48], kv_indices, lens, 0.1)
    with pytest.raises(ValueError, match="head counts"):
        ta.decode_attention(q[:, :3], kv, kv_indices, lens, 0.1)
    with pytest.raises(ValueError, match="int64"):
        ta.decode_attention(q, kv, kv_indices.int(), lens, 0.1)
    with pytest.raises(ValueError, match="batch"):
        ta.decode_attention(q, kv, kv_indices[:1], lens, 0.1)
    with pytest.raises(ValueError, match="do not match the tokens"):
        ta.extend_attention(q, kv, kv_indices, torch.zeros(1, dtype=torch.int64), lens, 0.1)
    with pytest.raises(ValueError, match="int64"):
        ta.extend_attention(q, kv, kv_indices, torch.zeros(2, dtype=torch.int32), lens, 0.1)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="only under Triton's interpreter"):
        ta.decode_attention(q, kv, kv_indices, lens, 0.1)
    if not ta.library_interpreted():  # this process imported Triton for the GPU
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        with pytest.raises(RuntimeError, match="set after Triton was imported"):
            ta.decode_attention(q, kv, kv_indices, lens, 0.1)


def cuda_build(dtype: torch.dtype, dim: int, heads: int, kv_heads: int, arch: int) -> Any:
    """The attention kernel compiled for sm_`arch` as a launch on these inputs would compile it."""
    q, kv, kv_indices, lens = paged_case(3, heads, kv_heads, dim, dtype)
    _, args, kwargs = ta.launch_arguments(
        q, kv, kv_indices, torch.arange(3), lens, 0.1, torch.empty_like(q), interpret=False
    )
    return build_for_cuda(ta.kernel(interpret=False), args, kwargs, arch)


@pytest.mark.parametrize(
    "dtype,dim,heads,kv_heads,arch",
    [
        (torch.bfloat16, 128, 32, 8, 90),  # the 1B benchmark model on an H200
        (torch.bfloat16, 64, 9, 3, 90),  # SmolLM2-135M
        (torch.float16, 256, 16, 2, 90),
        (torch.float32, 128, 16, 16, 90),
        (torch.bfloat16, 128, 64, 1, 80),  # a group of 64 (rows 64) on an A100
    ],
)
def test_kernel_builds_for_cuda_without_spills(
    dtype, dim, heads, kv_heads, arch, monkeypatch, tmp_path
):
    """What the interpreter cannot check: the kernel lowers for the GPU, its K/V gathers are
    pipelined async copies, it keeps within registers (no spill) and needs well under the
    smallest shared memory of the targets (sm_80: 164 KiB)."""
    if ta.library_interpreted():
        pytest.skip("this process imported Triton for the interpreter")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    compiled = cuda_build(dtype, dim, heads, kv_heads, arch)
    assert compiled.metadata.shared <= 100 * 1024
    assert "cp.async" in compiled.asm["ptx"]
    cuobjdump = Path(ta.triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    if not cuobjdump.is_file():
        return
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    usage = subprocess.run(
        [str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True, check=False
    ).stdout
    stack = re.search(r"STACK:(\d+)", usage)
    assert stack is not None, usage
    assert int(stack.group(1)) == 0, usage


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu():
    """The same checks compiled for the GPU at hand (MMA, ex2.approx: bits differ from the
    interpreter's): fp32 to 1e-5 of the reference, 16-bit as close as SDPA on CPU (worst error
    within 1.25 times its), and the invariance bit for bit, on the benchmark shapes too."""
    if ta.library_interpreted():
        pytest.skip("this process imported Triton for the interpreter")
    for heads, kv_heads in GROUPS:
        check_fp32(heads, kv_heads, 128, "cuda", tol=1e-5)
    for dtype in (torch.bfloat16, torch.float16):
        for dim in (64, 128, 256):
            check_as_close_as_sdpa(dtype, dim, "cuda", slack=1.25)
    for case in [*INVARIANCE_CASES, (torch.bfloat16, 32, 8, 128)]:
        check_invariance(*case, device="cuda")
