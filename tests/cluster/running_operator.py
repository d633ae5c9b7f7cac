"""`berth operator run` as it is installed: a real process with its own ServiceAccount's token.

The flags are the ones in the installed Deployment (manifests/operator/deployment.yaml), with
only the listening ports changed to free loopback ones. The credentials are a TokenRequest token
of the installed `berth-operator` ServiceAccount in a kubeconfig of their own: the operator runs
with exactly the RBAC that ships, never as an admin.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.controlplane import REPO_ROOT, ControlPlane, http_ok, tail
from tests.helpers import free_port, wait_for

DEPLOYMENT = REPO_ROOT / "manifests" / "operator" / "deployment.yaml"
NAMESPACE = "berth-system"
ACCOUNT = "berth-operator"
USERNAME = f"system:serviceaccount:{NAMESPACE}:{ACCOUNT}"
# Every resource the operator watches: it is ready once each of them is being watched.
WATCHED = frozenset(
    {
        "inferenceservices",
        "statefulsets",
        "deployments",
        "services",
        "poddisruptionbudgets",
        "ingresses",
        "serviceaccounts",
        "rolebindings",
        "pods",
    }
)


def installed_args(liveness_port: int, metrics_port: int) -> list[str]:
    """The operator container's command line from the Deployment, ports made local."""
    deployment = yaml.safe_load(DEPLOYMENT.read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = []
    for arg in [*container["command"][1:], *container["args"]]:
        if arg.startswith("--liveness="):
            path = arg.rsplit("/", 1)[1]
            arg = f"--liveness=http://127.0.0.1:{liveness_port}/{path}"
        elif arg.startswith("--metrics-port="):
            arg = f"--metrics-port={metrics_port}"
        args.append(arg)
    assert container["command"][0] == "berth", container["command"]
    return args


@dataclass
class RunningOperator:
    process: subprocess.Popen[bytes]
    log: Path
    kubeconfig: Path
    liveness_url: str
    metrics_url: str
    args: list[str]

    def check_running(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise AssertionError(f"the operator exited with {code}:\n{tail(self.log, 60)}")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
            return response.read().decode()

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, as the kubelet does; the exit code (killed after `timeout`: -9)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def restart(plane: ControlPlane, running: RunningOperator) -> int:
    """Stop the operator (SIGTERM) and start a new process in its place; the old exit code."""
    code = running.stop()
    fresh = start(plane, running.log.parent, log_name=f"operator-{time.time():.0f}.log")
    running.process, running.log, running.kubeconfig = fresh.process, fresh.log, fresh.kubeconfig
    running.liveness_url, running.metrics_url, running.args = (
        fresh.liveness_url,
        fresh.metrics_url,
        fresh.args,
    )
    return code


def start(
    plane: ControlPlane, workdir: Path, timeout: float = 60.0, log_name: str = "operator.log"
) -> RunningOperator:
    """Mint a token for the operator's ServiceAccount and run the operator with it; return once
    its liveness endpoint answers and every watch is open."""
    workdir.mkdir(parents=True, exist_ok=True)
    token = plane.kubectl(
        "create", "token", ACCOUNT, "-n", NAMESPACE, "--duration=4h"
    ).stdout.strip()
    kubeconfig = plane.write_token_kubeconfig(token, workdir / "operator.kubeconfig")
    liveness_port, metrics_port = free_port(), free_port()
    args = installed_args(liveness_port, metrics_port)
    log = workdir / log_name
    started = time.time()
    berth = Path(sys.executable).with_name("berth")
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(berth), *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            # Only what a container would have: its kubeconfig instead of a mounted token;
            # the packages this test process imports, from the same places.
            env={
                "KUBECONFIG": str(kubeconfig),
                "HOME": str(workdir),
                "PATH": "/usr/bin:/bin",
                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            },
        )
    running = RunningOperator(
        process=process,
        log=log,
        kubeconfig=kubeconfig,
        liveness_url=f"http://127.0.0.1:{liveness_port}/healthz",
        metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
        args=args,
    )

    def up() -> bool:
        if http_ok(running.liveness_url) and watched(plane, started) >= WATCHED:
            return True
        running.check_running()
        return False

    def not_up(message: str) -> AssertionError:
        return AssertionError(
            f"{message} (watching {sorted(watched(plane, started))}):\n{tail(log, 60)}"
        )

    try:
        wait_for(up, timeout, interval=0.2, what="the operator to start", error=not_up)
    except BaseException:
        with contextlib.suppress(Exception):
            running.stop(5)
        raise
    return running


def watched(plane: ControlPlane, since: float = 0.0) -> set[str]:
    return {
        event["objectRef"]["resource"]
        for event in requests(plane, since)
        if event["verb"] == "watch" and event.get("objectRef")
    }


def requests(plane: ControlPlane, since: float = 0.0) -> list[dict[str, Any]]:
    """The operator's requests (as audited) received at or after `since` (a Unix time)."""
    return [
        event
        for event in plane.audit_events(USERNAME)
        if unix(event["requestReceivedTimestamp"]) >= since
    ]


def unix(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
