"""What the end-to-end tests use of the running cluster: kubectl as the admin, JSON reads, waits,
port-forwards to Services (through the API server and the kubelet, as a user's would go), and the
logs a failed test's report carries."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from berth_common.server_process import free_port
from tests.cluster.controlplane import ControlPlane, KubectlError
from tests.e2e.node import Node
from tests.helpers import wait_for


@dataclass(frozen=True)
class Images:
    """The images `hack/e2e/images.sh` built, by the names containerd knows them by."""

    runtime: str
    router: str
    operator: str

    @classmethod
    def read(cls, directory: Path) -> Images:
        """From the `<name>.id` files (`<image ID> <name>`) next to the tarballs."""

        def name(image: str) -> str:
            path = directory / f"berth-{image}.id"
            if not path.is_file():
                raise FileNotFoundError(f"no {path}: hack/e2e/images.sh builds the images")
            return path.read_text().split()[1]

        return cls(runtime=name("runtime"), router=name("router"), operator=name("operator"))


@dataclass
class Cluster:
    plane: ControlPlane
    node: Node
    images: Images

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self.plane.kubectl(*args, stdin=stdin, check=check, timeout=timeout)

    def get(self, *args: str) -> dict[str, Any]:
        return self.plane.get(*args)

    def apply(self, namespace: str, body: dict[str, Any]) -> None:
        self.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(body))

    def wait_until(self, check: Callable[[], Any], timeout: float, what: str) -> Any:
        """Poll `check` every 2 s until it returns something true; what it reads may not exist
        yet (a kubectl error or a missing key is retried). On timeout, the last such error is
        part of the failure."""
        last: list[str] = []

        def attempt() -> Any:
            try:
                return check()
            except (AssertionError, KeyError, IndexError, KubectlError) as error:
                last[:] = [f"{type(error).__name__}: {error}"]
                raise

        try:
            return wait_for(
                attempt,
                timeout,
                interval=2,
                what=what,
                retry_on=(AssertionError, KeyError, IndexError, KubectlError),
                error=pytest.fail.Exception,
            )
        except pytest.fail.Exception as error:
            raise pytest.fail.Exception(f"{error}; last seen: {last[0] if last else '-'}") from None

    def exec(self, namespace: str, pod: str, *command: str) -> str:
        return self.kubectl("exec", "-n", namespace, pod, "--", *command).stdout

    @contextlib.contextmanager
    def port_forward(self, namespace: str, target: str, port: int) -> Iterator[str]:
        """`kubectl port-forward TARGET` (svc/NAME or pod/NAME) on a free local port; yields its
        base URL once /health answers through it."""
        local = free_port()
        log = self.plane.workdir / f"port-forward-{local}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [
                    str(self.plane.kubectl_binary),
                    "-n",
                    namespace,
                    "port-forward",
                    target,
                    f"{local}:{port}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.plane.env(),
            )
        url = f"http://127.0.0.1:{local}"
        try:

            def healthy() -> bool:
                if process.poll() is not None:
                    raise pytest.fail.Exception(f"port-forward exited: {log.read_text()}")
                with contextlib.suppress(httpx.HTTPError):
                    return httpx.get(f"{url}/health", timeout=5).status_code == 200
                return False

            wait_for(healthy, 60, interval=0.5, what=f"port-forward to {target}")
            yield url
        finally:
            process.terminate()
            process.wait(timeout=10)

    def failure_sections(self, namespace: str | None) -> list[tuple[str, str]]:
        """What a failed test's report shows: the operator's log, the namespace's pods and
        events, the node's logs."""

        def run(*args: str) -> str:
            result = self.kubectl(*args, check=False, timeout=30)
            return result.stdout + result.stderr

        sections = [
            (
                "operator log (last lines)",
                run("-n", "berth-system", "logs", "deployment/berth-operator", "--tail=80"),
            )
        ]
        if namespace:
            sections.append(("pods", run("-n", namespace, "get", "pods", "-o", "wide")))
            sections.append(
                ("events", run("-n", namespace, "get", "events", "--sort-by=.lastTimestamp"))
            )
        sections.append(("node logs (last lines)", self.node.log_tails()))
        return sections


class Timeline:
    """Events with the seconds since the first, for a test's log (and the run's summary)."""

    def __init__(self, lines: list[str]) -> None:
        self.start = time.monotonic()
        self.lines = lines

    def __call__(self, event: str) -> None:
        line = f"{time.monotonic() - self.start:7.1f} s  {event}"
        self.lines.append(line)
        print(line, flush=True)
