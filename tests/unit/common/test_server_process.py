"""ServerProcess: started on a free port, ready when its path answers 200, stopped by SIGTERM."""

from __future__ import annotations

import signal
import socket
import sys

import pytest

from berth_common.server_process import ServerProcess, free_port


def http_server(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]


def test_free_port_is_free() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_waits_until_ready_then_stops_with_sigterm() -> None:
    port = free_port()
    with ServerProcess(http_server(port), port, ready_path="/", name="test-http") as server:
        assert server.wait_ready(timeout=30, interval=0.05) is server
        assert server.startup_s is not None and server.startup_s >= 0
        assert server.base_url == f"http://127.0.0.1:{port}"
        assert server.proc.poll() is None
    assert server.proc.returncode == -signal.SIGTERM
    assert "GET / HTTP/1.1" in server.output()


def test_a_server_that_exits_first_fails_with_its_log() -> None:
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"]
    server = ServerProcess(cmd, port, name="test-exits")
    with pytest.raises(RuntimeError, match=r"exited with 3 before becoming ready:\nno such model"):
        server.wait_ready(timeout=30, interval=0.05)
    assert server.stop() == 3


def test_a_server_that_never_answers_times_out() -> None:
    port = free_port()
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    with (
        ServerProcess(cmd, port, name="test-silent") as server,
        pytest.raises(TimeoutError, match="not ready after"),
    ):
        server.wait_ready(timeout=0.3, interval=0.05)
    assert server.proc.returncode == -signal.SIGTERM
