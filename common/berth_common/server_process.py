"""ServerProcess: a server started as a subprocess on a free port, waited for until it answers HTTP,
and stopped with SIGTERM (benchmarks and tests start `berth serve` and `berth router` this way)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from berth_common.cli import berth_command

# The path that answers 200 once each `berth` server takes requests.
READY_PATHS = {"serve": "/health", "router": "/readiness"}


def free_port() -> int:
    """A loopback TCP port that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One server process on a loopback port; its output (stdout and stderr) goes to a log file.

    It runs in its own session, so a Ctrl-C meant for the caller does not reach it and `stop()`
    can kill its whole process group.
    """

    def __init__(
        self,
        cmd: list[str],
        port: int,
        ready_path: str = "/health",
        name: str = "berth-server",
        env: dict[str, str] | None = None,
    ) -> None:
        self.cmd = cmd
        self.port = port
        self.name = name
        self.ready_path = ready_path
        self.base_url = f"http://127.0.0.1:{port}"
        self.startup_s: float | None = None
        fd, log_name = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(log_name)
        self.log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        """Everything the server has logged so far."""
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 4000) -> str:
        return self.output()[-chars:]

    def wait_ready(self, timeout: float = 180.0, interval: float = 0.2) -> ServerProcess:
        """Block until `ready_path` answers 200 (`startup_s` says how long it took); raise
        RuntimeError if the process exits first, TimeoutError after `timeout` seconds."""
        started = time.monotonic()
        with httpx.Client(timeout=5, trust_env=False) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise RuntimeError(
                        f"{self.name} exited with {code} before becoming ready:\n{self.log_tail()}"
                    )
                try:
                    if client.get(self.base_url + self.ready_path).status_code == 200:
                        self.startup_s = time.monotonic() - started
                        return self
                except httpx.HTTPError:
                    pass
                if time.monotonic() - started > timeout:
                    raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s")
                time.sleep(interval)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then SIGKILL (to the whole group) if it has not exited after `timeout`;
        returns the exit code. The log file stays."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def berth_server(
    command: str,
    *args: str,
    name: str | None = None,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """`berth serve|router --port <free port> *args`, by this interpreter (not yet ready)."""
    port = free_port()
    cmd = berth_command(command, "--port", str(port), *args)
    return ServerProcess(cmd, port, READY_PATHS[command], name or f"berth-{command}", env)
