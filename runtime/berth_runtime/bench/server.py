"""Launch a server under test as a subprocess, wait for it, stop it, and measure its memory."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tree_memory(pid: int, with_pss: bool = False) -> dict[str, Any] | None:
    """RSS (and PSS) summed over `pid` and all its descendants; None if it is gone.

    RSS counts shared pages (libraries, torch) once per process, so the sum overstates what the
    tree really holds; PSS splits shared pages between the processes that map them."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    rss = 0
    pss: int | None = 0 if with_pss else None
    by_process = []
    for proc in procs:
        try:
            if with_pss:
                info = proc.memory_full_info()
                proc_pss = getattr(info, "pss", info.uss)
                pss = (pss or 0) + proc_pss
                title = " ".join(proc.cmdline()).strip()[:60] or proc.name()
                by_process.append(
                    {"pid": proc.pid, "title": title, "rss": info.rss, "pss": proc_pss}
                )
            else:
                info = proc.memory_info()
            rss += info.rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    if not by_process and not rss:
        return None
    count = len(by_process) if with_pss else len(procs)
    out: dict[str, Any] = {"processes": count, "rss_bytes": rss, "pss_bytes": pss}
    if with_pss:
        out["by_process"] = by_process
    return out


class MemorySampler:
    """Samples a process tree's summed RSS in a thread; keeps the peak."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.pid = pid
        self.interval = interval
        self.peak_rss = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> dict[str, Any] | None:
        mem = tree_memory(self.pid)
        if mem is not None:
            self.peak_rss = max(self.peak_rss, mem["rss_bytes"])
            self.samples += 1
        return mem

    def start(self) -> MemorySampler:
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any] | None:
        """Stop sampling; the final reading with PSS plus the peak RSS, in MiB."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        final = tree_memory(self.pid, with_pss=True)
        if final is None and not self.samples:
            return None
        mib = 1024 * 1024
        peak = max(self.peak_rss, final["rss_bytes"] if final else 0)
        return {
            "pid": self.pid,
            "processes": final["processes"] if final else None,
            "peak_rss_mib": peak / mib,
            "rss_mib": final["rss_bytes"] / mib if final else None,
            "pss_mib": final["pss_bytes"] / mib if final and final["pss_bytes"] else None,
            "by_process": [
                {"pid": p["pid"], "title": p["title"], "rss_mib": p["rss"] / mib}
                for p in (final or {}).get("by_process", [])
            ],
        }


class LaunchedServer:
    """A server process on a free loopback port: started, waited for, stopped (SIGTERM)."""

    def __init__(
        self,
        cmd: list[str],
        port: int,
        health_path: str = "/health",
        name: str = "server",
        env: dict[str, str] | None = None,
    ) -> None:
        self.cmd = cmd
        self.port = port
        self.name = name
        self.health_path = health_path
        self.base_url = f"http://127.0.0.1:{port}"
        fd, log_name = tempfile.mkstemp(prefix=f"berth-bench-{name}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(log_name)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout: float = 600.0) -> float:
        """Block until the health path answers 200; the seconds it took. Raises if it died."""
        started = time.monotonic()
        deadline = started + timeout
        with httpx.Client(timeout=5, trust_env=False) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise RuntimeError(
                        f"{self.name} exited with {code} before becoming ready:\n{self.log_tail()}"
                    )
                try:
                    if client.get(self.base_url + self.health_path).status_code == 200:
                        return time.monotonic() - started
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s")
                time.sleep(0.25)

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode

    def __enter__(self) -> LaunchedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch_berth(server_args: list[str], port: int | None = None) -> LaunchedServer:
    """`berth serve` with `server_args` on a free port (the same interpreter as this one)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "berth_runtime.cli", "serve", "--port", str(port), *server_args]
    return LaunchedServer(cmd, port, "/health", name="berth")


def find_llama_cpp() -> tuple[str, list[str]] | None:
    """How to start llama.cpp's server here: ("llama-server", argv prefix), or
    ("llama_cpp.server", argv prefix) for llama-cpp-python's; None when neither is installed."""
    binary = shutil.which("llama-server")
    if binary:
        return "llama-server", [binary]
    if importlib.util.find_spec("llama_cpp") is not None:
        with contextlib.suppress(ImportError, ValueError):
            if importlib.util.find_spec("llama_cpp.server") is not None:
                return "llama_cpp.server", [sys.executable, "-m", "llama_cpp.server"]
    return None


def launch_llama_cpp(
    kind: str, prefix: list[str], gguf: str, parallel: int, ctx_per_slot: int
) -> LaunchedServer:
    """llama.cpp's server on the GGUF file: continuous batching over `parallel` slots."""
    port = free_port()
    threads = str(os.cpu_count() or 1)
    if kind == "llama-server":
        cmd = [
            *prefix,
            *("-m", gguf, "--host", "127.0.0.1", "--port", str(port)),
            *("-np", str(parallel), "-c", str(parallel * ctx_per_slot), "-t", threads),
            "--cont-batching",
        ]
        return LaunchedServer(cmd, port, "/health", name="llama-server")
    cmd = [
        *prefix,
        *("--model", gguf, "--host", "127.0.0.1", "--port", str(port)),
        *("--n_ctx", str(ctx_per_slot), "--n_threads", threads),
    ]
    return LaunchedServer(cmd, port, "/v1/models", name="llama_cpp.server")
