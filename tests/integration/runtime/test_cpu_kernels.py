"""Berth's C++ CPU kernels (`--attention-backend berth_cpu`): paged decode attention and RMSNorm
against PyTorch references, every SIMD level the loader builds, the build/load/fallback paths,
and the real model on both backends."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from berth_runtime.kernels import cpu as cpu_kernels
from berth_runtime.model_executor.model_runner import ModelRunner
from berth_runtime.models.loader import default_cache_dir
from tests.helpers import embedded_tokenizer, needs_bf16
from tests.integration.runtime.chat_prompts import QUESTIONS
from tests.integration.runtime.engine_steps import forced_decode_logits, greedy_run, load_runner


@pytest.fixture(scope="module", autouse=True)
def kernels() -> Path:
    return cpu_kernels.load(default_cache_dir())


def paged_case(batch, heads, kv_heads, dim, dtype, seed=0, slots=512):
    """Random q and pool, ragged lengths 1..L, scattered slots; the padding columns of
    kv_indices point at a poisoned slot that must never be read."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(slots + 2, 2 * kv_heads, dim, generator=gen).to(dtype)
    poison = slots + 1
    kv[poison] = 1e4
    lens = torch.randint(1, 40, (batch,), generator=gen)
    lens[0] = 1
    lens[-1] = 45
    width = int(lens.max()) + 3
    kv_indices = torch.full((batch, width), poison, dtype=torch.int64)
    perm = torch.randperm(slots, generator=gen) + 1
    offset = 0
    for b in range(batch):
        n = int(lens[b])
        kv_indices[b, :n] = perm[offset : offset + n]
        offset += n
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    return q, kv, kv_indices, lens


def reference_attention(q, kv, kv_indices, lens, scale):
    """fp64 attention per sequence over its own slots (query head h reads KV head h // group)."""
    batch, heads, dim = q.shape
    kv_heads = kv.shape[1] // 2
    out = torch.empty(batch, heads, dim, dtype=torch.float64)
    for b in range(batch):
        rows = kv[kv_indices[b, : lens[b]]].double()  # [n, 2 * Hkv, D]
        keys = rows[:, :kv_heads].repeat_interleave(heads // kv_heads, dim=1)
        values = rows[:, kv_heads:].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), keys) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    return out


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 8), (16, 2)])
@pytest.mark.parametrize("dim", [64, 128])
def test_decode_attention_fp32_matches_reference(heads, kv_heads, dim):
    q, kv, kv_indices, lens = paged_case(6, heads, kv_heads, dim, torch.float32)
    scale = dim**-0.5
    out = torch.ops.berth.decode_attention(q, kv, kv_indices, lens, scale)
    torch.testing.assert_close(
        out.double(), reference_attention(q, kv, kv_indices, lens, scale), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_decode_attention_bf16_is_as_close_as_sdpa(dim):
    q, kv, kv_indices, lens = paged_case(8, 9, 3, dim, torch.bfloat16, seed=1)
    scale = dim**-0.5
    exact = reference_attention(q, kv, kv_indices, lens, scale)
    ours = torch.ops.berth.decode_attention(q, kv, kv_indices, lens, scale).double()
    # SDPA in bf16 over the same inputs, gathered and padded as the torch_native backend does.
    width = kv_indices.shape[1]
    gathered = kv[kv_indices.clamp(max=kv.shape[0] - 2)]  # padding columns masked below
    keys, values = gathered[:, :, :3].transpose(1, 2), gathered[:, :, 3:].transpose(1, 2)
    mask = (torch.arange(width)[None] < lens[:, None])[:, None, None, :]
    sdpa = F.scaled_dot_product_attention(
        q.view(8, 3, 3, dim), keys, values, attn_mask=mask, scale=scale
    ).reshape(8, 9, dim)
    sdpa_error = (sdpa.double() - exact).abs().max().item()
    our_error = (ours - exact).abs().max().item()
    assert our_error <= max(1.5 * sdpa_error, 1e-3), (our_error, sdpa_error)


def test_decode_attention_reads_in_place_after_writes():
    """The pool is read where it lies: a later write to a sequence's slot changes its output."""
    q, kv, kv_indices, lens = paged_case(2, 4, 2, 64, torch.float32, seed=2)
    before = torch.ops.berth.decode_attention(q, kv, kv_indices, lens, 0.125)
    kv[kv_indices[1, 0]] += 3.0
    after = torch.ops.berth.decode_attention(q, kv, kv_indices, lens, 0.125)
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    assert not torch.allclose(after[1], before[1])


def test_decode_attention_rejects_bad_input():
    q, kv, kv_indices, lens = paged_case(2, 4, 2, 64, torch.float32)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        torch.ops.berth.decode_attention(q.bfloat16(), kv, kv_indices, lens, 0.1)
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        torch.ops.berth.decode_attention(q.half(), kv.half(), kv_indices, lens, 0.1)
    with pytest.raises(RuntimeError, match="head dim"):
        torch.ops.berth.decode_attention(q[..., :48], kv[..., :48], kv_indices, lens, 0.1)
    with pytest.raises(RuntimeError, match="head counts"):
        torch.ops.berth.decode_attention(q[:, :3], kv, kv_indices, lens, 0.1)
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.berth.decode_attention(q, kv, kv_indices.int(), lens, 0.1)
    with pytest.raises(RuntimeError, match="batch"):
        torch.ops.berth.decode_attention(q, kv, kv_indices[:1], lens, 0.1)


def extend_case(extend_lens, prefix_lens, heads, kv_heads, dim, dtype, seed=4):
    """Sequences of prefix + new tokens in a scattered pool; returns the extend op's inputs and,
    per new token, its own (kv_indices row, length) for the decode op and the reference."""
    q_all, kv, kv_indices, _ = paged_case(len(extend_lens), heads, kv_heads, dim, dtype, seed)
    gen = torch.Generator().manual_seed(seed)
    total = [p + e for p, e in zip(prefix_lens, extend_lens)]
    width = max(total) + 2
    poison = kv.shape[0] - 1
    perm = torch.randperm(kv.shape[0] - 2, generator=gen) + 1
    kv_indices = torch.full((len(total), width), poison, dtype=torch.int64)
    offset = 0
    for b, n in enumerate(total):
        kv_indices[b, :n] = perm[offset : offset + n]
        offset += n
    query_seq = torch.repeat_interleave(torch.arange(len(total)), torch.tensor(extend_lens))
    query_lens = torch.cat(
        [torch.arange(p + 1, p + e + 1) for p, e in zip(prefix_lens, extend_lens)]
    )
    q = torch.randn(len(query_seq), heads, dim, generator=gen).to(dtype)
    return q, kv, kv_indices, query_seq, query_lens


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 8), (16, 2)])
@pytest.mark.parametrize("dim", [64, 128])
def test_extend_attention_fp32_matches_reference(heads, kv_heads, dim):
    """Ragged extends after cached prefixes (0 to 40 tokens), more new tokens than one block."""
    q, kv, kv_indices, seq, lens = extend_case(
        [1, 37, 5, 20], [0, 3, 40, 17], heads, kv_heads, dim, torch.float32
    )
    out = torch.ops.berth.extend_attention(q, kv, kv_indices, seq, lens, dim**-0.5)
    expected = reference_attention(q, kv, kv_indices[seq], lens, dim**-0.5)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_attention_is_the_same_in_every_kind_of_step(dtype):
    """Bit for bit: a token's output is the same extended in one step with its whole sequence,
    in any split of it, next to other sequences, or as a decode step of its own."""
    q, kv, kv_indices, seq, lens = extend_case([30, 9], [0, 21], 9, 3, 64, dtype)
    whole = torch.ops.berth.extend_attention(q, kv, kv_indices, seq, lens, 0.125)
    for split in ([1, 29], [16, 14], [17, 13], [29, 1]):
        parts, start = [], 0
        for n in split:
            rows = slice(start, start + n)
            parts.append(
                torch.ops.berth.extend_attention(
                    q[rows], kv, kv_indices[:1], seq[rows], lens[rows], 0.125
                )
            )
            start += n
        assert torch.equal(torch.cat(parts), whole[:30]), split
    alone = torch.ops.berth.extend_attention(
        q[30:], kv, kv_indices[1:], seq[30:] - 1, lens[30:], 0.125
    )
    assert torch.equal(alone, whole[30:])
    decoded = torch.ops.berth.decode_attention(q, kv, kv_indices[seq], lens, 0.125)
    assert torch.equal(decoded, whole)


def test_extend_attention_rejects_bad_input():
    q, kv, kv_indices, seq, lens = extend_case([3, 2], [0, 4], 4, 2, 64, torch.float32)
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.berth.extend_attention(q, kv, kv_indices, seq.int(), lens, 0.1)
    with pytest.raises(RuntimeError, match="do not match the tokens"):
        torch.ops.berth.extend_attention(q, kv, kv_indices, seq[:2], lens, 0.1)
    with pytest.raises(RuntimeError, match="head dim"):
        torch.ops.berth.extend_attention(q[..., :48], kv[..., :48], kv_indices, seq, lens, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_indices_finds_the_largest_entries(dtype):
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 49157, generator=gen) * 5).to(dtype)  # not a multiple of the SIMD width
    x[3, -1] = 100.0  # the maximum in the scalar tail
    x[4] = 1.0  # all equal: any k of them
    for k in (1, 2, 32):
        got = torch.ops.berth.top_k_indices(x, k)
        assert got.shape == (7, k) and got.dtype == torch.int64
        values = x.gather(1, got).sort(dim=-1, descending=True).values
        assert torch.equal(values, x.topk(k, dim=-1).values)
        assert all(len(set(row)) == k for row in got.tolist())
    assert int(torch.ops.berth.top_k_indices(x, 1)[3, 0]) == 49156
    with pytest.raises(RuntimeError, match="k must be"):
        torch.ops.berth.top_k_indices(x, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dot_rows_computes_exact_scores_independently_of_other_rows(dtype):
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(5, 576, generator=gen).to(dtype)
    weight = torch.randn(1000, 576, generator=gen).to(dtype)
    picks = torch.randint(0, 1000, (5, 8), generator=gen)
    got = torch.ops.berth.dot_rows(hidden, weight, picks)
    assert got.dtype == torch.float32
    exact = torch.einsum("rd,rkd->rk", hidden.double(), weight[picks].double())
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-4)
    alone = torch.ops.berth.dot_rows(hidden[2:3], weight, picks[2:3])
    assert torch.equal(alone[0], got[2])
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.berth.dot_rows(hidden, weight, picks.int())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_pytorch(dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 576, generator=gen).to(dtype)
    residual = torch.randn(37, 576, generator=gen).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    tol = {"rtol": 0, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(
        torch.ops.berth.rms_norm(x, weight, 1e-5), F.rms_norm(x, (576,), weight, 1e-5), **tol
    )
    normed, summed = torch.ops.berth.add_rms_norm(x, residual, weight, 1e-5)
    # The residual sum is rounded exactly as an add in the storage dtype.
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(normed, F.rms_norm(x + residual, (576,), weight, 1e-5), **tol)


def test_rms_norm_rejects_bad_input():
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="last dim"):
        torch.ops.berth.rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(RuntimeError, match="residual must match"):
        torch.ops.berth.add_rms_norm(x, torch.randn(4, 32), torch.ones(64), 1e-6)


CHECK_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from berth_runtime.kernels import cpu
    sys.path.insert(0, ".")
    from tests.integration.runtime.test_cpu_kernels import paged_case, reference_attention
    path = cpu.load(Path(sys.argv[1]))
    q, kv, idx, lens = paged_case(5, 9, 3, 64, torch.float32, seed=4)
    out = torch.ops.berth.decode_attention(q, kv, idx, lens, 0.125)
    torch.testing.assert_close(out.double(), reference_attention(q, kv, idx, lens, 0.125),
                               rtol=1e-5, atol=1e-5)
    x, w = torch.randn(3, 576), torch.randn(576)
    torch.testing.assert_close(torch.ops.berth.rms_norm(x, w, 1e-6),
                               torch.nn.functional.rms_norm(x, (576,), w, 1e-6))
    print(cpu.cpu_capability(), path.name)
    """
)


def run_check(cache_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """CHECK_SCRIPT in a fresh interpreter: load (or build) the kernels, compare with the
    references, print the SIMD level and the library's file name."""
    return subprocess.run(
        [sys.executable, "-c", CHECK_SCRIPT, str(cache_dir)],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).parents[3],
        timeout=240,
    )


@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT"])
def test_other_simd_levels_build_and_agree(capability, tmp_path):
    """The loader builds for the level PyTorch dispatches to (ATEN_CPU_CAPABILITY forces a lower
    one here); each build gives the reference results."""
    if capability == "AVX2" and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU has no AVX2")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability.lower()}
    env.pop(cpu_kernels.KERNELS_DIR_ENV, None)
    result = run_check(tmp_path, env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[0] == capability
    assert (tmp_path / "kernels" / cpu_kernels.library_name(capability)).is_file()


def test_build_errors_are_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(cpu_kernels.KernelBuildError, match="no C\\+\\+ compiler"):
        cpu_kernels.build(tmp_path, "DEFAULT")
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with pytest.raises(cpu_kernels.KernelBuildError, match="building the CPU kernels failed"):
        cpu_kernels.build(tmp_path, "DEFAULT")
    assert not list(tmp_path.glob("*.so")), "a failed build leaves no library behind"


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user may enter (pytest's own are the owner's only)."""
    path = Path(tempfile.mkdtemp(prefix="berth-kernels-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_prebuilt_directory_is_used_first(tmp_path, shared_dir):
    """Images ship prebuilt libraries in $BERTH_KERNELS_DIR (built by the Dockerfile's step,
    `python -m berth_runtime.kernels.cpu DIR`): found there, nothing is compiled (no compiler on
    PATH) and the cache stays empty. In a subprocess: a process can register the torch.ops.berth
    library only once."""
    assert cpu_kernels.main([str(shared_dir)]) == 0
    prebuilt = shared_dir / cpu_kernels.library_name(cpu_kernels.cpu_capability())
    # Readable by every user, as a compiler's output is: an image builds its kernels as root and
    # runs as another user (a 0600 file left its pods on the slow attention fallback).
    assert prebuilt.stat().st_mode & 0o777 == 0o644
    if os.geteuid() == 0:  # read it as nobody, as the image's runtime user would
        result = subprocess.run(["head", "-c", "4", str(prebuilt)], capture_output=True, user=65534)
        assert result.returncode == 0 and result.stdout == b"\x7fELF", result.stderr
    env = {
        **os.environ,
        cpu_kernels.KERNELS_DIR_ENV: str(prebuilt.parent),
        "CXX": str(tmp_path / "no-such-compiler"),
    }
    result = run_check(tmp_path / "cache", env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[1] == prebuilt.name
    assert not (tmp_path / "cache" / "kernels").exists()


def test_auto_falls_back_to_torch_native_when_kernels_cannot_build(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    monkeypatch.setattr(cpu_kernels, "_error", None)
    monkeypatch.delenv(cpu_kernels.KERNELS_DIR_ENV, raising=False)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    runner = load_runner(dtype="float32", model_cache_dir=str(tmp_path))
    assert runner.attention_backend == "torch_native"
    assert "CPU kernels unavailable" in caplog.text
    with pytest.raises(ValueError, match="--attention-backend berth_cpu: no C\\+\\+ compiler"):
        load_runner(dtype="float32", attention_backend="berth_cpu", model_cache_dir=str(tmp_path))


def test_float16_keeps_torch_native():
    """The kernels take fp32 and bf16; --dtype float16 on CPU runs on PyTorch's own ops."""
    runner = load_runner(dtype="float16", max_total_tokens=256)
    assert runner.attention_backend == "torch_native"
    _, tokens = greedy_run(runner, [embedded_tokenizer().encode("The capital of France is")], 2)
    assert len(tokens[0]) == 3
    with pytest.raises(ValueError, match="berth_cpu takes float32 or bfloat16"):
        load_runner(dtype="float16", attention_backend="berth_cpu")


# bf16 rounding is chaotic: one prompt's error moves by tens of percent with any change of
# kernel, so the backends are compared over a dozen.
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", *QUESTIONS[:10]]


def runner(dtype: str, backend: str) -> ModelRunner:
    # The 4-bit GGUF path off: only the kernels differ here.
    return load_runner(
        dtype=dtype, attention_backend=backend, max_total_tokens=512, gguf_q4_max_batch=0
    )


@pytest.fixture(scope="module")
def fp32_reference() -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
    """Prompts, fp32 torch_native's 16 greedy tokens each, and its teacher-forced logits."""
    prompts = [embedded_tokenizer().encode(p) for p in PROMPTS]
    native = runner("float32", "torch_native")
    _, tokens = greedy_run(native, prompts, 16)
    native.kv_pool.clear()
    steps = [seq[:16] for seq in tokens]
    return prompts, steps, forced_decode_logits(native, prompts, steps)


def test_fp32_model_on_berth_cpu_matches_torch_native(fp32_reference):
    """Ragged batch of three, teacher-forced: the same logits to fp32 rounding, same tokens."""
    prompts, steps, expected = fp32_reference
    kernel = runner("float32", "berth_cpu")
    assert kernel.attention_backend == "berth_cpu"
    got = forced_decode_logits(kernel, prompts, steps)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-3)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@needs_bf16
def test_bf16_model_on_berth_cpu_is_as_close_to_fp32_as_torch_native(fp32_reference):
    """In bf16 the two backends round differently, so neither equals the other: each is held to
    its distance from the fp32 model on the same inputs."""
    prompts, steps, exact = fp32_reference
    errors, tokens = {}, {}
    for backend in ("torch_native", "berth_cpu"):
        bf16 = runner("bfloat16", backend)
        assert bf16.attention_backend == backend
        logits = forced_decode_logits(bf16, prompts, steps)
        errors[backend] = (logits - exact).abs()
        tokens[backend] = logits.argmax(-1)
    native, kernel = errors["torch_native"], errors["berth_cpu"]
    assert kernel.mean() <= 1.25 * native.mean(), (kernel.mean(), native.mean())
    assert kernel.max() <= 1.5 * native.max(), (kernel.max(), native.max())
    # Where fp32's top two are further apart than twice bf16's typical error at the top, both
    # backends pick fp32's token (closer ones are near-ties either may break either way).
    top2 = exact.topk(2, dim=-1).values
    typical = native.gather(-1, exact.argmax(-1, keepdim=True)).mean()
    clear = (top2[..., 0] - top2[..., 1]) > 2 * typical
    assert clear.float().mean() >= 0.9
    for backend in ("torch_native", "berth_cpu"):
        assert torch.equal(tokens[backend][clear], exact.argmax(-1)[clear]), backend
