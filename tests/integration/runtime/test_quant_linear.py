"""Berth's quantized projection kernel (`torch.ops.berth.quant_linear`, kernels/quant_linear*.cpp):
its 4-bit and 8-bit packings, its arithmetic against an fp64 reference of the same int8 scheme,
row independence, every instruction set's path (AVX2, AVX-512BW, VNNI) giving the same bits, bad
input, the embedded model's projections, and its 8-bit lm_head keeping greedy choices and leading
logprobs in bf16 and fp32."""

from __future__ import annotations

import pytest
import torch

from berth_runtime.kernels import cpu as cpu_kernels
from berth_runtime.models.gguf_q4 import (
    Int4Weight,
    dequantize,
    dequantize_q4_vnni,
    pack_q4_vnni,
    read_q4_groups,
)
from berth_runtime.models.int8_lm_head import Int8LmHead, dequantize_q8, quantize_rows_q8
from berth_runtime.models.layers.logits import exact_top_logits
from berth_runtime.models.loader import default_cache_dir
from tests.helpers import BUILTIN_GGUF, embedded_gguf_dir, needs_bf16
from tests.integration.runtime.engine_steps import load_runner

# The kernel's instruction sets, each needing the ones before.
ISAS = ("avx2", "avx512bw", "avx512_vnni")


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    cpu_kernels.load(default_cache_dir())
    if not cpu_kernels.quant_linear_available():
        pytest.skip("needs AVX2 or AVX-512BW: small steps keep PyTorch's int4 and bf16 kernels")


def available_isas() -> list[str]:
    best = cpu_kernels.quant_linear_isa()
    return list(ISAS[: ISAS.index(best) + 1])


def every_isa(x: torch.Tensor, codes: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """quant_linear on each instruction set this CPU has: the same bits from each, returned."""
    outs = {isa: torch.ops.berth.quant_linear(x, codes, pairs, isa) for isa in available_isas()}
    auto = torch.ops.berth.quant_linear(x, codes, pairs)
    for isa, out in outs.items():
        assert torch.equal(out, auto), isa
    return auto


def random_groups(n: int, k: int, seed: int = 0, q4_0: bool = False):
    """Codes, scales and zeros as `read_q4_groups` gives them, from fp16 d and m as in a GGUF."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half().float()
    m = -8 * d if q4_0 else (-torch.rand(n, k // 32, generator=gen) * 0.2).half().float()
    return codes, d, m + 8 * d


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The kernel's scheme in fp64: x quantized to int8 per block of 32 (scale amax / 127,
    rounded to nearest even in fp32, as the kernel does), times the 4-bit weight."""
    blocks = x.float().view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv).clamp(-128, 127)
    scale = amax / 127
    quantized = (codes * scale).view(x.shape[0], -1)
    return quantized.double() @ weight.double().T


@pytest.mark.parametrize("q4_0", [False, True])
def test_packing_keeps_every_weight_exactly(q4_0):
    codes, scales, zeros = random_groups(64, 96, q4_0=q4_0)
    packed, pairs = pack_q4_vnni(codes, scales, zeros)
    assert packed.shape == (4, 3, 4, 16, 4) and pairs.shape == (4, 3, 2, 16)
    assert torch.equal(dequantize_q4_vnni(packed, pairs), dequantize(codes, scales, zeros))


def test_packing_refuses_shapes_it_cannot_lay_out():
    codes, scales, zeros = random_groups(24, 64)
    with pytest.raises(ValueError, match="N % 16"):
        pack_q4_vnni(codes, scales, zeros)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_matches_the_fp64_reference_of_its_scheme(rows, dtype):
    codes, scales, zeros = random_groups(96, 576, seed=rows)
    packed, pairs = pack_q4_vnni(codes, scales, zeros)
    weight = dequantize(codes, scales, zeros)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(7)).to(dtype)
    out = every_isa(x, packed, pairs)
    assert out.dtype == dtype and out.shape == (rows, 96)
    expected = reference(x, weight)
    # fp32 accumulation of exact integer block sums; bf16 output rounds to 8 bits.
    tolerance = 1e-5 if dtype == torch.float32 else 4e-3
    error = ((out.double() - expected).abs() / expected.abs().amax()).max().item()
    assert error < tolerance
    # And close to the float product: int8 activations cost about what bf16 ones do.
    exact = x.double() @ weight.double().T
    assert ((out.double() - exact).abs().max() / exact.abs().amax()).item() < 0.02


def test_a_row_gives_the_same_bits_in_any_batch():
    codes, scales, zeros = random_groups(160, 1536, seed=3)
    packed, pairs = pack_q4_vnni(codes, scales, zeros)
    x = torch.randn(13, 1536, generator=torch.Generator().manual_seed(1)).bfloat16()
    alone = [torch.ops.berth.quant_linear(x[i : i + 1], packed, pairs) for i in range(13)]
    for rows in (2, 5, 8, 9, 13):
        together = torch.ops.berth.quant_linear(x[:rows], packed, pairs)
        for i in range(rows):
            assert torch.equal(together[i : i + 1], alone[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 6, 8, 13])
def test_every_instruction_set_gives_the_same_bits(rows, dtype):
    """AVX2 (a 256-bit vector a half group, 16-bit pair sums) and AVX-512 (BW and VNNI) compute
    the same exact integer sums and the same float steps: a decode step's tokens do not depend
    on the CPU's vector width."""
    if len(available_isas()) < 2:
        pytest.skip("one instruction set here (AVX2): comparing them needs an AVX-512 CPU")
    gen = torch.Generator().manual_seed(rows)
    codes, scales, zeros = random_groups(64, 576, seed=5)
    packed, pairs = pack_q4_vnni(codes, scales, zeros)
    codes8, pairs8 = quantize_rows_q8(torch.randn(48, 576, generator=gen))
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    every_isa(x, packed, pairs)
    every_isa(x, codes8, pairs8)


def test_an_instruction_set_the_cpu_lacks_is_a_clear_error():
    codes, scales, zeros = random_groups(32, 64)
    packed, pairs = pack_q4_vnni(codes, scales, zeros)
    with pytest.raises(RuntimeError, match="unknown isa 'sse9'"):
        torch.ops.berth.quant_linear(torch.zeros(1, 64), packed, pairs, "sse9")
    missing = [isa for isa in ISAS if isa not in available_isas()]
    if missing:
        with pytest.raises(RuntimeError, match=f"{missing[0]} is not available on this CPU"):
            torch.ops.berth.quant_linear(torch.zeros(1, 64), packed, pairs, missing[0])


def test_zero_rows_and_zero_blocks():
    codes, scales, zeros = random_groups(32, 64)
    packed, pairs = pack_q4_vnni(codes, scales, zeros)
    assert torch.ops.berth.quant_linear(torch.zeros(0, 64), packed, pairs).shape == (0, 32)
    out = torch.ops.berth.quant_linear(torch.zeros(2, 64), packed, pairs)
    assert torch.equal(out, torch.zeros(2, 32))  # an all-zero block has scale 0, not NaN


def test_bad_input_is_a_clear_error():
    codes, scales, zeros = random_groups(32, 64)
    packed, pairs = pack_q4_vnni(codes, scales, zeros)
    with pytest.raises(RuntimeError, match="x has 96 columns, weight 64"):
        torch.ops.berth.quant_linear(torch.zeros(1, 96), packed, pairs)
    with pytest.raises(RuntimeError, match="codes must be uint8"):
        torch.ops.berth.quant_linear(torch.zeros(1, 64), packed.view(2, -1), pairs)
    with pytest.raises(RuntimeError, match="scales must be fp16"):
        torch.ops.berth.quant_linear(torch.zeros(1, 64), packed, pairs.float())
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        torch.ops.berth.quant_linear(torch.zeros(1, 64, dtype=torch.float64), packed, pairs)


def test_the_embedded_models_projections_on_it():
    """Every 4-bit projection of the embedded GGUF, through Int4Weight both ways: Berth's kernel
    is as close to the float weight's product as PyTorch's int4 kernel is, within a factor."""
    groups = read_q4_groups(embedded_gguf_dir() / BUILTIN_GGUF)
    names = [key.removesuffix(".codes") for key in groups if key.endswith(".codes")]
    gen = torch.Generator().manual_seed(0)
    ours_total = theirs_total = 0.0
    for name in names[:14]:  # two layers: every projection shape
        fields = [groups[f"{name}.{f}"] for f in ("codes", "scales", "zeros")]
        weight = dequantize(*fields)
        x = torch.randn(4, weight.shape[1], generator=gen).bfloat16()
        exact = x.double() @ weight.double().T
        ours = Int4Weight(*fields, max_rows=8, integer=True).matmul(x)
        theirs = Int4Weight(*fields, max_rows=8).matmul(x)
        scale = exact.abs().amax().item()
        ours_total += (ours.double() - exact).abs().mean().item() / scale
        theirs_total += (theirs.double() - exact).abs().mean().item() / scale
    assert ours_total < 3 * theirs_total, (ours_total, theirs_total)


def test_8bit_packing_round_trips_and_stays_within_half_a_step():
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(2))
    weight[3, :32] = 0  # an all-zero block: scale 0, codes 128
    codes, pairs = quantize_rows_q8(weight)
    assert codes.shape == (3, 3, 8, 16, 4) and pairs.shape == (3, 3, 2, 16)
    restored = dequantize_q8(codes, pairs)
    step = weight.view(48, 3, 32).abs().amax(-1, keepdim=True) / 127
    assert ((restored.view(48, 3, 32) - weight.view(48, 3, 32)).abs() <= 0.5 * step * 1.01).all()
    assert torch.equal(restored[3, :32], torch.zeros(32))


@pytest.mark.parametrize("rows", [1, 4, 8])
def test_8bit_matches_the_fp64_reference_of_its_scheme(rows):
    weight = torch.randn(64, 576, generator=torch.Generator().manual_seed(rows))
    codes, pairs = quantize_rows_q8(weight)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(9))
    out = every_isa(x, codes, pairs)
    expected = reference(x, dequantize_q8(codes, pairs))
    assert ((out.double() - expected).abs() / expected.abs().amax()).max().item() < 1e-5


def test_8bit_lm_head_pads_an_odd_vocabulary():
    weight = torch.randn(70, 64).bfloat16()
    head = Int8LmHead(weight, max_rows=8)
    x = torch.randn(2, 64).bfloat16()
    scores = head.scores(x)
    assert scores.shape == (2, 70)
    exact = x.double() @ weight.double().T
    assert ((scores.double() - exact).abs().max() / exact.abs().max()).item() < 0.03


@pytest.fixture(scope="module")
def bf16_runner():
    return load_runner(dtype="bfloat16", max_total_tokens=512, gguf_q4_max_batch=0)


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=needs_bf16), "float32"])
def test_8bit_lm_head_keeps_greedy_choices_and_leading_logprobs(dtype):
    """The embedded model's lm_head on real hidden states (its own embeddings through the final
    norm, and random mixes of them): after the exact recomputation of each row's leading
    candidates, the top token and the top-20 logprobs match the plain lm_head's (bf16, or fp32
    as AVX2 CPUs serve by default), and the tail's scores are about as far from fp64 as bf16
    rounding puts them."""
    model = load_runner(dtype=dtype, max_total_tokens=512, gguf_q4_max_batch=0).model
    weight = model.lm_head_weight()
    gen = torch.Generator().manual_seed(0)
    picks = torch.randint(0, weight.shape[0], (64, 3), generator=gen)
    mix = torch.rand(64, 3, 1, generator=gen)
    with torch.inference_mode():
        hidden = model.norm((weight[picks].float() * mix).sum(1).to(weight.dtype))[0]
        head = Int8LmHead(weight, max_rows=64)
        ours = exact_top_logits(head.scores(hidden), hidden, weight, True)
        theirs = model.compute_logits(hidden)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    top = theirs.topk(20).indices
    ours_lp, theirs_lp = ours.log_softmax(-1), theirs.log_softmax(-1)
    assert (ours_lp.gather(1, top) - theirs_lp.gather(1, top)).abs().max().item() < 0.01
    exact = hidden.double() @ weight.double().T
    tail_ours = (ours.double() - exact).abs().mean().item()
    tail_bf16 = (exact.bfloat16().double() - exact).abs().mean().item()  # rounding alone
    assert tail_ours < 4 * tail_bf16, (tail_ours, tail_bf16)


def dequantized(packed: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    out = torch.empty(packed.shape[0] * 16, packed.shape[1] * 32, dtype=torch.bfloat16)
    torch.ops.berth.quant_dequantize(packed, pairs, out)
    return out


@pytest.mark.parametrize("q4_0", [False, True])
def test_dequantize_gives_the_bf16_rounding_of_the_exact_weight(q4_0):
    codes, scales, zeros = random_groups(64, 96, q4_0=q4_0)
    packed, pairs = pack_q4_vnni(codes, scales, zeros)
    expected = dequantize_q4_vnni(packed, pairs).bfloat16()
    assert torch.equal(dequantized(packed, pairs).view(torch.int16), expected.view(torch.int16))
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(5))
    codes8, pairs8 = quantize_rows_q8(weight)
    expected8 = dequantize_q8(codes8, pairs8).bfloat16()
    assert torch.equal(dequantized(codes8, pairs8).view(torch.int16), expected8.view(torch.int16))


def test_dequantize_refuses_an_out_it_cannot_fill():
    codes, scales, zeros = random_groups(32, 64)
    packed, pairs = pack_q4_vnni(codes, scales, zeros)
    for out in (torch.empty(32, 96, dtype=torch.bfloat16), torch.empty(32, 64)):
        with pytest.raises(RuntimeError, match=r"out must be a contiguous bf16 \[32, 64\]"):
            torch.ops.berth.quant_dequantize(packed, pairs, out)


def test_the_embedded_models_4bit_weights_dequantize_to_its_bf16_checkpoint():
    """Bit for bit: a step run on the dequantized weight is the step a bf16 copy would run."""
    from safetensors.torch import load_file

    from tests.helpers import embedded_model_dir

    checkpoint = load_file(f"{embedded_model_dir()}/model.safetensors")
    groups = read_q4_groups(embedded_gguf_dir() / BUILTIN_GGUF)
    names = [key.removesuffix(".codes") for key in groups if key.endswith(".codes")]
    assert len(names) == 7 * 30
    for name in names:
        packed, pairs = pack_q4_vnni(*(groups[f"{name}.{f}"] for f in ("codes", "scales", "zeros")))
        bf16 = checkpoint[name].bfloat16()
        assert torch.equal(dequantized(packed, pairs).view(torch.int16), bf16.view(torch.int16))


@needs_bf16
def test_defaults_keep_no_bf16_projections_and_prefill_as_if_they_did(bf16_runner):
    """At defaults the 4-bit weights are the projections' only copy; a prefill of any length
    computes, from their dequantized bf16, exactly what the bf16 weights do."""
    from berth_runtime.model_executor.forward_batch import ForwardBatch

    lean = load_runner(dtype="bfloat16", max_total_tokens=512)
    assert lean.q4_kernel == "berth_int8"
    projections = [
        m.weight for layer in lean.model.layers for m in layer.modules() if hasattr(m, "berth_int4")
    ]
    assert len(projections) == 4 * 30 and all(w is None for w in projections)
    assert bf16_runner.weight_bytes - lean.weight_bytes > 190 * 2**20
    for length in (5, 100):
        outs = []
        for runner in (lean, bf16_runner):
            slots = runner.kv_pool.alloc(length)
            table = runner.req_to_token_pool.req_to_token
            table[1, :length] = slots
            ids = [(7 * i + 3) % 4000 for i in range(length)]
            batch = ForwardBatch.extend(ids, [0], [length], slots, [1], table, runner.device)
            outs.append(runner.forward(batch))
            runner.kv_pool.free(slots)
        assert torch.equal(outs[0], outs[1]), length
    # Rows beyond the 8-bit lm_head's: oneDNN on the plain embedding, as on its packed copy.
    assert lean.model.packed_lm_head is None and bf16_runner.model.packed_lm_head is not None
    hidden = outs[0].repeat(2, 1)[:130]
    assert torch.equal(lean.compute_logits(hidden), bf16_runner.compute_logits(hidden))
