"""What Berth reads of the CPU (`utils.cpu_isa`): the flags that decide bf16, and the
$BERTH_CPU_ISA cap that makes an AVX-512 machine take an AVX2-only CPU's paths."""

from __future__ import annotations

import os

import pytest

from berth_runtime.utils import cpu_isa

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
SKYLAKE_X = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
ZEN4 = SKYLAKE_X | {"avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}
ARROW_LAKE = AVX2 | {"avx_vnni", "avx_ne_convert"}


@pytest.fixture
def flags(monkeypatch):
    """Pretend the CPU has the given flags (and no cap is set)."""
    monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)

    def pretend(cpu: frozenset[str] | None) -> None:
        monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: cpu)

    return pretend


@pytest.mark.parametrize(
    ("cpu", "runs_bf16", "native"),
    [
        (AVX2, False, False),
        (SKYLAKE_X, True, False),  # oneDNN emulates bf16 on AVX-512: it runs, slower than fp32
        (ZEN4, True, True),
        (SAPPHIRE_RAPIDS, True, True),
        (ARROW_LAKE, True, False),
    ],
)
def test_bf16_follows_the_cpu_flags(flags, cpu, runs_bf16, native):
    flags(cpu)
    assert (cpu_isa.bf16_problem() is None) is runs_bf16
    assert cpu_isa.has_native_bf16() is native


def test_unknown_flags_leave_the_question_to_pytorch(flags):
    flags(None)  # another OS or architecture
    assert cpu_isa.bf16_problem() is None
    assert cpu_isa.has_native_bf16() is None


def test_the_avx2_cap_refuses_bf16_on_any_cpu(flags, monkeypatch):
    flags(SAPPHIRE_RAPIDS)
    monkeypatch.setenv(cpu_isa.ISA_ENV, "AVX2")
    assert cpu_isa.isa_cap() == "avx2"
    assert cpu_isa.bf16_problem() == cpu_isa.NO_BF16_MESSAGE
    assert "use --dtype float32" in cpu_isa.NO_BF16_MESSAGE
    assert cpu_isa.has_native_bf16() is False


def test_the_cap_reaches_pytorch_onednn_and_mkl_unless_already_set(monkeypatch):
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")
    cpu_isa.apply_isa_cap()
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert os.environ["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"


def test_an_unknown_cap_is_an_error_but_not_at_import(monkeypatch):
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx3")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    cpu_isa.apply_isa_cap()  # berth_runtime's import: leaves the refusal to `berth serve`
    assert "ATEN_CPU_CAPABILITY" not in os.environ
    with pytest.raises(ValueError, match="expected one of avx2 or unset"):
        cpu_isa.isa_cap()
