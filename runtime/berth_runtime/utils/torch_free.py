"""Keep torch out of the processes that do not run the model, and run torch work elsewhere.

The API and detokenizer processes need a tokenizer, not a model. transformers >= 5 imports torch
whenever it is installed, and xgrammar imports it too: about 700 MB of private memory in each
process that does so, for nothing (measured: 790 MB RSS after `import torch`, 118 MB for a
transformers tokenizer without it). `forbid_torch()` makes those processes tokenizer-only, and
`run_isolated()` runs the few start-up steps that do need torch (converting a GGUF file, asking
CUDA for a device) in a short-lived child process, so the server's long-lived processes never load
it. The scheduler does run torch, but reads its config and tokenizer under `torch_hidden()` first,
so that transformers leaves out the torch parts it would load for them.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import TypeVar

T = TypeVar("T")


def forbid_torch() -> None:
    """From now on `import torch` fails in this process, and libraries that probe for torch
    (transformers' `is_torch_available()`) see none. Call it first thing in a process's entry
    point; a process that already imported torch is left as it is."""
    # A None entry in sys.modules is Python's documented way to make an import fail; find_spec()
    # then answers None, which is how transformers asks.
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    # transformers would print "PyTorch was not found..." once per process: expected here.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@contextlib.contextmanager
def torch_hidden() -> Iterator[None]:
    """Within: torch cannot be imported and libraries that probe for it see none, as after
    `forbid_torch()`; after: it imports again. For a process that runs torch later but first
    loads what transformers reads (config, tokenizer): transformers >= 5, finding torch,
    imports its model-loading code with it (torch.distributed.tensor, sympy: 45 MB of the
    scheduler's memory, measured). transformers remembers what it found, so this comes before
    its first use. No effect in a process that already imported torch."""
    if "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None  # type: ignore[assignment]
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        yield
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]


def torch_is_loaded() -> bool:
    """Whether this process has imported torch."""
    return sys.modules.get("torch") is not None


def run_isolated(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a fresh spawned process: its result, or its exception raised here.

    What the child imports (torch, a model) and allocates dies with it. `fn`, its arguments, its
    result and its exceptions must pickle. (A bare Process and Pipe: an executor would also leave
    multiprocessing's resource tracker running beside the server.)"""
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_run_and_send, args=(writer, fn, args), daemon=True)
    child.start()
    writer.close()
    try:
        ok, value = reader.recv()
    except EOFError:
        child.join()
        died = f"{fn.__name__} died in its process (exit code {child.exitcode})"
        raise RuntimeError(died) from None
    finally:
        reader.close()
    child.join()
    if not ok:
        raise value
    return value


def _run_and_send(writer: Connection, fn: Callable[..., object], args: tuple) -> None:
    try:
        outcome = (True, fn(*args))
    except Exception as e:  # sent to the parent, which raises it
        outcome = (False, e)
    writer.send(outcome)
    writer.close()
