"""Berth serving runtime: the OpenAI-compatible API server and the engine behind it."""

from berth_common import __version__
from berth_runtime.utils.cpu_isa import apply_isa_cap

# Before anything imports torch: a $BERTH_CPU_ISA cap must reach PyTorch, oneDNN and MKL.
apply_isa_cap()

__all__ = ["__version__"]
