"""Fixtures for the cluster tests: one real control plane per run, Berth installed on it from
its own manifests, one operator process, a namespace per test.

The control plane (controlplane.py) runs from the binaries that `make control-plane` builds and
caches; it is never built here. It is scoped to this package: started for the first test in
tests/cluster/ and stopped after the last, so it does not idle through the rest of the session.
So are the install (`kubectl apply -k manifests/`) and the operator (running_operator.py), which
every test that needs one shares. When a test here fails, the end of each component's log (and
of the operator's) is attached to its report.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from berth_operator import constants as c
from tests.cluster import running_operator
from tests.cluster.controlplane import (
    REPO_ROOT,
    ControlPlane,
    ControlPlaneError,
    ControlPlaneNotBuilt,
    binaries_dir,
    tail,
)
from tests.cluster.running_operator import RunningOperator
from tests.helpers import wait_for

_running: ControlPlane | None = None
_operator: RunningOperator | None = None
# Figures a test measured, printed at the end of the run (name -> line).
REPORTED: dict[str, str] = {}
# The operator's role narrowed on purpose by a test, as (apiGroup, resource, verb, since, until)
# in Unix time: test_rbac_and_load.py lets a refusal of that verb through if it came in that
# window (in any namespace: the role is cluster-wide, and any service the operator re-applies
# then is refused too) and no other.
RBAC_DENIED_ON_PURPOSE: list[tuple[str, str, str, float, float]] = []
MANIFESTS = REPO_ROOT / "manifests"
CRD_NAME = f"{c.PLURAL}.{c.GROUP}"
OPENAPI_PATH = f"apis/{c.GROUP}/{c.VERSION}"
# Runs last: it reads what the operator did in every other test of the package.
LAST_MODULE = "test_rbac_and_load.py"


@pytest.fixture(scope="package")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok, running."""
    global _running
    try:
        binaries = binaries_dir()
    except ControlPlaneNotBuilt as error:
        missing = str(error)
    else:
        missing = ""
    if missing:
        pytest.fail(missing, pytrace=False)
    plane = ControlPlane(tmp_path_factory.mktemp("control-plane"), binaries)
    plane.start()
    _running = plane
    print(f"\ncontrol plane up in {plane.startup_seconds:.1f} s at {plane.server}")
    try:
        yield plane
    finally:
        _running = None
        plane.stop()


@pytest.fixture(autouse=True)
def _components_alive(request: pytest.FixtureRequest) -> None:
    """Fail a test up front, with the log, if a component of the control plane has died."""
    if "control_plane" in request.fixturenames:
        request.getfixturevalue("control_plane").check_running()


@pytest.fixture(scope="package")
def kubeconfig(control_plane: ControlPlane) -> Path:
    """The admin kubeconfig (user in system:masters)."""
    return control_plane.kubeconfig


@pytest.fixture
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    """A fresh namespace, deleted (without waiting) after the test."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    control_plane.kubectl("create", "namespace", name)
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="package")
def installed(control_plane: ControlPlane) -> ControlPlane:
    """Berth installed as a user installs it: `kubectl apply -k manifests/`, CRD Established."""
    result = control_plane.kubectl("apply", "-k", str(MANIFESTS), check=False)
    if result.returncode != 0:
        pytest.fail(f"kubectl apply -k manifests/ failed:\n{result.stderr}", pytrace=False)
    control_plane.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=30s")
    # `kubectl api-resources` reads discovery afresh (and refreshes kubectl's cache, which the
    # kubectl calls before the install filled): wait until it serves the new kind.
    wait_for(
        lambda: (
            c.PLURAL
            in control_plane.kubectl("api-resources", f"--api-group={c.GROUP}", "-o", "name").stdout
        ),
        30,
        what="discovery to serve InferenceServices",
        error=ControlPlaneError,
    )

    # Established and in discovery is not yet published in /openapi/v3, which `kubectl explain`
    # (and client-side validation) read: the API server adds a new CRD's schema a moment later.
    def openapi_paths() -> dict[str, object]:
        return json.loads(control_plane.kubectl("get", "--raw", "/openapi/v3").stdout)["paths"]

    wait_for(
        lambda: OPENAPI_PATH in openapi_paths(),
        30,
        what=f"/openapi/v3 to publish {OPENAPI_PATH}",
        error=ControlPlaneError,
    )
    return control_plane


@pytest.fixture(scope="package")
def berth_operator(
    installed: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningOperator]:
    """The operator, running as installed (its ServiceAccount's token, the Deployment's flags),
    shared by the package. It must stop cleanly on SIGTERM at the end."""
    global _operator
    process = running_operator.start(installed, tmp_path_factory.mktemp("operator"))
    _operator = process
    try:
        yield process
    finally:
        _operator = None
        code = process.stop()
    if code != 0:
        pytest.fail(f"the operator exited with {code} on SIGTERM:\n{tail(process.log, 60)}")


@pytest.fixture
def serving_namespace(
    namespace: str, berth_operator: RunningOperator, installed: ControlPlane
) -> str:
    """A namespace for InferenceServices, enforcing PodSecurity `restricted`, with the operator
    running."""
    berth_operator.check_running()
    installed.kubectl(
        "label",
        "namespace",
        namespace,
        "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/warn=restricted",
    )
    return namespace


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The RBAC and API-load checks read what the operator did in all the other tests: last."""
    here = Path(__file__).parent
    last = [item for item in items if item.path == here / LAST_MODULE]
    ours = [i for i, item in enumerate(items) if item.path.parent == here]
    if not last or not ours:
        return
    end = ours[-1] + 1  # the package stays together: its control plane is started once
    rest = [item for item in items[:end] if item.path != here / LAST_MODULE]
    items[:] = rest + last + items[end:]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if REPORTED:
        terminalreporter.section("measured on the real API server")
        for line in REPORTED.values():
            terminalreporter.write_line(line)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and _running is not None:
        report.sections.append(("control plane logs (last lines)", _running.log_tails()))
    if report.failed and _operator is not None:
        report.sections.append(("operator log (last lines)", tail(_operator.log, 80)))
    return report
