"""Fixtures for the end-to-end tests: a real one-node cluster (the tests' control plane and a real
kubelet, node.py), Berth installed on it from `manifests/` with the images `hack/e2e/images.sh`
built from this checkout, and a namespace per test. `make e2e` builds everything, then runs these.

The cluster is started once for the package and torn down after its last test, also when one
fails; a run killed outright is swept up by the next one (node.sweep). When a test fails, its
report carries the operator's log, the pods of its namespace and the node's logs.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import yaml

from tests.cluster.controlplane import ControlPlane, ControlPlaneNotBuilt, binaries_dir
from tests.e2e import node as real_node
from tests.e2e import node_config
from tests.e2e.cluster import Cluster, Images

_running: Cluster | None = None
# Timelines the tests logged, printed at the end of the run (title -> lines).
TIMELINES: dict[str, list[str]] = {}
IMAGES_DIR = Path(
    os.environ.get("BERTH_E2E_IMAGES")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "berth/e2e/images"
)
MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The control plane and one real node, Ready, with this checkout's images on it."""
    global _running
    if os.geteuid() != 0:
        pytest.fail("the e2e tests run a kubelet and containerd: they need root", pytrace=False)
    try:
        images = Images.read(IMAGES_DIR)
        plane_binaries = binaries_dir()
        node_binaries = real_node.node_binaries_dir()
    except (ControlPlaneNotBuilt, real_node.NodeError, FileNotFoundError) as error:
        pytest.fail(f"{error}\n`make e2e` builds all of it first.", pytrace=False)
    workdir = tmp_path_factory.mktemp("e2e")
    plane = ControlPlane(
        workdir / "control-plane",
        plane_binaries,
        nodes=(),
        address=node_config.HOST_IP,
        extra_clients=node_config.NODE_CLIENTS,
    )
    node = real_node.Node(workdir / "node", node_binaries, plane, IMAGES_DIR)
    running = Cluster(plane, node, images)
    # SIGTERM (a CI timeout, `kill`) tears down as Ctrl-C does, instead of leaving pods running.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        node.create_network()
        plane.start()
        node.start()
        _running = running
        yield running
    finally:
        _running = None
        node.stop()
        plane.stop()
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="package")
def installed(cluster: Cluster) -> Cluster:
    """`kubectl apply -k manifests/` with the images built here; the operator rolled out."""
    docs = list(yaml.safe_load_all(cluster.kubectl("kustomize", str(MANIFESTS)).stdout))
    for doc in docs:
        if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "berth-operator":
            container = doc["spec"]["template"]["spec"]["containers"][0]
            container["image"] = cluster.images.operator
            container["args"] += [
                f"--runtime-image={cluster.images.runtime}",
                f"--router-image={cluster.images.router}",
            ]
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump_all(docs))
    cluster.kubectl(
        "wait", "--for=condition=Established", "crd/inferenceservices.serving.berth.dev"
    )
    cluster.kubectl(
        "-n",
        "berth-system",
        "rollout",
        "status",
        "deployment/berth-operator",
        "--timeout=180s",
        timeout=200,
    )
    return cluster


@pytest.fixture
def namespace(installed: Cluster) -> Iterator[str]:
    """A fresh namespace, deleted after the test (its pods gone before the next test starts:
    the node has two CPUs)."""
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    installed.kubectl("create", "namespace", name)
    yield name
    installed.kubectl("delete", "namespace", name, "--timeout=180s", check=False, timeout=200)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for title, lines in TIMELINES.items():
        terminalreporter.section(title)
        for line in lines:
            terminalreporter.write_line(line)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and _running is not None:
        namespace = item.funcargs.get("namespace") if hasattr(item, "funcargs") else None
        report.sections.extend(_running.failure_sections(namespace))
    return report
