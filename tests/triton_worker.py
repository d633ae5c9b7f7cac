"""Running Triton kernels without a GPU, for the kernel tests: through Triton's interpreter in a
worker process, and compiled for CUDA targets.

The interpreter needs TRITON_INTERPRET=1 before Triton is imported (Triton wraps its own library
for the interpreter or the GPU at import), and the pytest process may have imported it already:
tests marked @interpreted run in one worker process spawned with it set, shared by the session.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

_worker: ProcessPoolExecutor | None = None


def _stop_worker() -> None:
    global _worker
    if _worker is not None:
        _worker.shutdown(cancel_futures=True)
        _worker = None


def interpreter_worker() -> ProcessPoolExecutor:
    """The worker process, spawned (not forked: Triton may be imported here already) with
    TRITON_INTERPRET=1 in its environment."""
    global _worker
    if _worker is None:
        _worker = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        atexit.register(_stop_worker)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("TRITON_INTERPRET", "1")
            # One thread each for torch and numpy: the interpreter's tensors are tiny.
            env.setenv("OMP_NUM_THREADS", "1")
            env.setenv("OPENBLAS_NUM_THREADS", "1")
            _worker.submit(os.getpid).result(timeout=120)  # the process starts here
    return _worker


def _run_interpreted(module: str, name: str, kwargs: dict[str, Any]) -> None:
    """In the worker: the undecorated test `name` of `module`."""
    getattr(importlib.import_module(module), name).__wrapped__(**kwargs)


def interpreted(test: Callable[..., None]) -> Callable[..., None]:
    """Run the test in the interpreter worker; its failure (with the worker's traceback) is
    raised here. Its parameters come from parametrize only (no fixtures)."""

    @functools.wraps(test)
    def run(**kwargs: Any) -> None:
        job = interpreter_worker().submit(_run_interpreted, test.__module__, test.__name__, kwargs)
        job.result(timeout=600)

    return run


def build_for_cuda(jit_fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], arch: int) -> Any:
    """Compile `jit_fn` for sm_`arch` with the specialization a launch with these arguments
    would get (Triton's own binder), without a GPU. Uses Triton internals: skips if they moved."""
    import triton

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.jit import create_function_from_signature

        target = GPUTarget("cuda", arch, 32)
        backend = make_backend(target)
        binder = create_function_from_signature(jit_fn.signature, jit_fn.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = jit_fn._pack_args(
            backend, kwargs, bound, specialization, options
        )
        source = ASTSource(jit_fn, signature, constexprs, attrs)
    except (ImportError, AttributeError, TypeError) as e:  # pragma: no cover - another Triton
        pytest.skip(f"this Triton's internals differ: {e}")
    return triton.compile(source, target=target, options=options.__dict__)
