"""`berth operator run` as a real process: kubeconfig login, liveness, metrics, reconcile,
SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.unit.operator.factories import REPO_ROOT

from .conftest import Cluster, eventually
from .test_operator_kmock import NS, STS, isvc, reason


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_berth_operator_run_serves_liveness_reconciles_and_stops_on_sigterm(
    cluster: Cluster, tmp_path: Path
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": cluster.url}}],
                "users": [{"name": "test", "user": {"token": "t0ken"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}],
                "current-context": "kmock",
            }
        )
    )
    port = free_port()
    metrics_port = free_port()
    log = (tmp_path / "operator.log").open("wb")
    code = "import sys; from berth_runtime.cli import main; sys.exit(main())"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        "operator",
        "run",
        "--standalone",
        f"--liveness=http://127.0.0.1:{port}/healthz",
        f"--metrics-port={metrics_port}",
        "--observe-interval=0.5",
        "--runtime-image=registry.test/berth:cli",
        cwd=REPO_ROOT,
        env={
            "KUBECONFIG": str(kubeconfig),
            "PYTHONPATH": f"{REPO_ROOT / 'runtime'}:{REPO_ROOT / 'operator'}",
            "PATH": "/usr/bin:/bin",
        },
        stdout=log,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with aiohttp.ClientSession() as session:

            async def live() -> bool:
                try:
                    async with session.get(f"http://127.0.0.1:{port}/healthz") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            deadline = asyncio.get_running_loop().time() + 30
            while not await live():
                assert proc.returncode is None, "the operator exited"
                assert asyncio.get_running_loop().time() < deadline, "no liveness endpoint"
                await asyncio.sleep(0.1)

        await eventually(
            lambda: any(
                r.params.get("watch") == "true" and r.url.path.endswith("/pods")
                for r in cluster.requests()
            ),
            timeout=30,
            what="the operator's watches",
        )
        await cluster.create(isvc("chat", {}))
        sts = await eventually(lambda: cluster.get(STS, NS, "chat"), timeout=30)
        image = sts["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image == "registry.test/berth:cli"
        # The token from the kubeconfig is what both kopf and the operator's client send.
        tokens = {
            r.headers.get("Authorization")
            for r in cluster.requests()
            if r.resource is not None and not r.headers.get("User-Agent", "").startswith("kmock/")
        }
        assert tokens == {"Bearer t0ken"}
        await eventually(lambda: reason(cluster, "chat") == "RanksNotReady", timeout=30)

        # The operator's own metrics: its decision for the new InferenceService.
        async with aiohttp.ClientSession() as session:
            desired = 'berth_operator_desired_ranks{name="chat",namespace="team-a"} 1.0'
            deadline = asyncio.get_running_loop().time() + 30
            while True:
                async with session.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                    assert r.status == 200
                    text = await r.text()
                if desired in text:
                    break
                assert asyncio.get_running_loop().time() < deadline, text
                await asyncio.sleep(0.2)
            assert 'berth_operator_serving_ranks{name="chat",namespace="team-a"} 0.0' in text
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout=30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            pytest.fail("the operator did not stop on SIGTERM")
        finally:
            log.close()
    assert proc.returncode == 0, (tmp_path / "operator.log").read_text()
