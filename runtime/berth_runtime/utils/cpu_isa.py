"""What this CPU offers Berth and PyTorch (bf16, AVX-512), optionally capped by $BERTH_CPU_ISA.

`BERTH_CPU_ISA=avx2` makes an AVX-512 machine take every path an AVX2-only CPU takes: PyTorch's
own kernels (`ATEN_CPU_CAPABILITY`), oneDNN (`ONEDNN_MAX_CPU_ISA`), MKL
(`MKL_ENABLE_INSTRUCTIONS`), Berth's C++ kernels (built for AVX2; `quant_linear.cpp` reads the same
variable) and Berth's own choices (bf16 refused, fp32 by default). The machines this project is
built and tested on change CPU from one day to the next, so CI runs the AVX2 paths this way on
whatever CPU it gets. The three library variables must be set before torch starts: `berth_runtime`
calls `apply_isa_cap` on import, and child processes inherit them.

No torch here: the API process asks these questions before it starts the scheduler.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

ISA_ENV = "BERTH_CPU_ISA"
# The caps one may ask for: each names the most a CPU may offer.
ISA_CAPS = ("avx2",)
# What PyTorch's oneDNN bf16 matmuls need (`mkldnn_bf16_device_check`); without it they raise
# "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq".
_BF16_MATMUL_FLAGS = ({"avx512bw", "avx512vl", "avx512dq"}, {"avx_ne_convert"})
# bf16 arithmetic in hardware (otherwise oneDNN emulates it, slower than fp32).
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")

NO_BF16_MESSAGE = (
    "this CPU has no bf16 support (AVX-512BW/VL/DQ, AVX512-BF16, AMX or AVX-NE-CONVERT); "
    "use --dtype float32"
)


def isa_cap() -> str | None:
    """The cap $BERTH_CPU_ISA sets (`avx2`), or None; ValueError for a value it does not know."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if not value:
        return None
    if value not in ISA_CAPS:
        raise ValueError(f"${ISA_ENV}={value!r}: expected one of {', '.join(ISA_CAPS)} or unset")
    return value


def apply_isa_cap() -> None:
    """Put the cap into the variables PyTorch, oneDNN and MKL read when they start (a variable
    already set is left as it is). An unknown value is left for `berth serve` to refuse."""
    try:
        cap = isa_cap()
    except ValueError:
        return
    if cap == "avx2":
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
        os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", "AVX2")


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The x86 feature flags Linux reports for this CPU, or None where it reports none (another
    OS or architecture: then PyTorch's own checks decide)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return None


def bf16_problem() -> str | None:
    """Why bf16 cannot run on this CPU (`NO_BF16_MESSAGE`), or None where it can or the flags are
    unknown."""
    if isa_cap() == "avx2":
        return NO_BF16_MESSAGE
    flags = cpu_flags()
    if flags is None or any(needed <= flags for needed in _BF16_MATMUL_FLAGS):
        return None
    return NO_BF16_MESSAGE


def has_native_bf16() -> bool | None:
    """AVX512-BF16 or AMX (bf16 matmuls in hardware), False under an AVX2 cap, None where the
    flags are unknown."""
    if isa_cap() == "avx2":
        return False
    flags = cpu_flags()
    if flags is None:
        return None
    return any(flag in flags for flag in _NATIVE_BF16_FLAGS)
