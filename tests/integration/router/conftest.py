"""Real processes on loopback: three `berth serve --dp-rank i` ranks and `berth router`s over them.

The ranks start once per module (in parallel: each start costs seconds on a small machine) and
every test reuses them; a test that kills a rank must come last in its module.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from berth_common.cli import berth_command
from berth_common.server_process import ServerProcess, free_port
from tests.helpers import RunningServer, embedded_model_dir, running_servers

RANKS = 3


class RunningRouter(ServerProcess):
    """A real `berth router` process on a free loopback port."""

    def __init__(self, *args: str) -> None:
        port = free_port()
        cmd = berth_command("router", "--port", str(port), *args)
        super().__init__(cmd, port, "/readiness", name="berth-router-test")

    def workers(self) -> dict[int, dict]:
        body = httpx.get(f"{self.base_url}/workers", timeout=5).json()
        return {w["dp_rank"]: w for w in body["workers"]}


class Always503(http.server.BaseHTTPRequestHandler):
    """A 'rank' that passes its health checks but refuses every request (a full queue)."""

    rank = 3

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/get_server_info":
            self._json(200, {"dp_rank": self.rank})
        elif self.path == "/get_load":
            self._json(200, {"num_running_reqs": 0, "num_waiting_reqs": 0})
        else:
            self._json(404, {"error": {"message": "no", "type": "NotFoundError"}})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = {
            "error": {
                "message": "the queue is full",
                "type": "ServiceUnavailableError",
                "param": None,
                "code": 503,
            }
        }
        self._json(503, body, {"Retry-After": "1", "X-Data-Parallel-Rank": str(self.rank)})

    def _json(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        return None


@pytest.fixture(scope="module")
def ranks() -> Iterator[list[RunningServer]]:
    model_dir = embedded_model_dir()
    args = [
        ["--model", model_dir, "--dp-rank", str(i), "--max-total-tokens", "8192"]
        for i in range(RANKS)
    ]
    with running_servers(args) as servers:
        yield servers


@pytest.fixture(scope="module")
def model(ranks: list[RunningServer]) -> str:
    return httpx.get(f"{ranks[0].base_url}/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def router(ranks: list[RunningServer]) -> Iterator[RunningRouter]:
    """cache_aware over the three ranks, with fast health checks."""
    srv = RunningRouter(
        "--worker-urls",
        *(r.base_url for r in ranks),
        "--health-check-interval",
        "0.5",
        "--log-level",
        "info",
    ).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def always_503() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Always503)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def mixed_router(ranks: list[RunningServer], always_503: str) -> Iterator[RunningRouter]:
    """Ranks 0-2 real, rank 3 answers every request 503, rank 4 is not listening at all."""
    srv = RunningRouter(
        "--worker-urls",
        *(r.base_url for r in ranks),
        always_503,
        f"http://127.0.0.1:{free_port()}",
        "--policy",
        "round_robin",
    ).wait_ready()
    yield srv
    srv.stop()
