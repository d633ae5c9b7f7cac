"""Return the C heap's free pages to the operating system (glibc's malloc_trim)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def release_free_memory() -> bool:
    """Hand the heap's free pages back, after a phase that freed much (a model load that
    dropped intermediate copies). glibc keeps freed small and mid-sized blocks mapped for reuse:
    after loading, tens of MB the process will never need again stay in its RSS. Returns
    whether anything was released; False where the C library has no malloc_trim."""
    trim = _malloc_trim()
    if trim is None:
        return False
    return bool(trim(0))
