"""The cluster tests' control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler
and kwok, run as local processes from the binaries that `make control-plane` builds, and the
kubectl built with them (the API server's own version, never the one on PATH).

Everything listens on free loopback ports, with certificates made for the run (`pki.py`). The API
server runs Node,RBAC authorization and its default admission plugins (PodSecurity included) plus
OwnerReferencesPermissionEnforcement (as many managed clusters enable it), and signs
ServiceAccount tokens, so TokenRequest works. The controller-manager runs every controller
with per-controller ServiceAccount credentials. kwok keeps fake Nodes Ready and takes pods that the
scheduler binds to them to Running and Ready; no container runs, no image is pulled.

Each component logs to `<workdir>/logs/<name>.log`. The processes are killed if the test process
dies (PR_SET_PDEATHSIG), so none outlives a crashed run.

The API server writes an audit log (`audit_events()`) of every request made by a ServiceAccount
of the `berth-system` namespace, the operator's: the tests read from it what the operator really
asked for (RBAC, API load), as the API server saw it.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.cluster import pki
from tests.helpers import free_port, wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "hack" / "control-plane" / "build.sh"
BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
)
KWOK_STAGES = "kwok-stages.yaml"

SERVICE_CIDR = "10.96.0.0/24"
POD_CIDR = "10.244.0.0/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
LOG_VERBOSITY = "1"
# kwok manages the Nodes that carry this annotation, and only those.
KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
# Audited: every request of a ServiceAccount in this namespace (the operator's), metadata only.
AUDITED_NAMESPACE = "berth-system"
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "userGroups": [f"system:serviceaccounts:{AUDITED_NAMESPACE}"]},
        {"level": "None"},
    ],
}


@dataclass(frozen=True)
class FakeNode:
    """A Node that kwok keeps Ready; `allocatable` is what the scheduler may place on it."""

    name: str
    ip: str
    allocatable: Mapping[str, str]
    labels: Mapping[str, str] = field(default_factory=dict)


DEFAULT_NODES = (
    FakeNode("kwok-cpu-0", "10.240.0.10", {"cpu": "16", "memory": "64Gi", "pods": "110"}),
    FakeNode(
        "kwok-gpu-0",
        "10.240.0.11",
        {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "8"},
        {"nvidia.com/gpu.present": "true"},
    ),
)


class ControlPlaneNotBuilt(RuntimeError):
    """The binaries are not in the cache: `make control-plane` builds them."""


class ControlPlaneError(RuntimeError):
    """A component failed to start or stopped unexpectedly; the message carries its log."""


class KubectlError(RuntimeError):
    """kubectl exited with an error; the message carries its stderr."""


def binaries_dir() -> Path:
    """The cache directory that holds this checkout's pinned binaries; raises if any is missing."""
    result = subprocess.run(
        [str(BUILD_SCRIPT), "--print-dir"], capture_output=True, text=True, check=True
    )
    directory = Path(result.stdout.strip())
    missing = [name for name in (*BINARIES, KWOK_STAGES) if not (directory / name).is_file()]
    if missing:
        raise ControlPlaneNotBuilt(
            f"the control plane for the cluster tests is not built: {', '.join(missing)} missing "
            f"in {directory}. Run `make control-plane` (builds etcd, kube-apiserver, "
            "kube-controller-manager, kube-scheduler, kubectl and kwok from source once, then "
            "reuses them)."
        )
    return directory


_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    """In the child, before exec: be killed when the process that started us dies."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class Component:
    """One running binary and its log file."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def check_running(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise ControlPlaneError(
                f"{self.name} exited with code {code}; the end of {self.log}:\n{tail(self.log)}"
            )

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds; always reaps the process."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def rss_bytes(self) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))
        return int(kib) * 1024


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return response.status == 200
    except (OSError, http.client.HTTPException):  # URLError, refused, reset, timed out, TLS
        return False


class ControlPlane:
    """A control plane that lives in `workdir`: `start()` brings it up, `stop()` tears it down."""

    def __init__(
        self,
        workdir: Path,
        binaries: Path,
        nodes: tuple[FakeNode, ...] = DEFAULT_NODES,
        address: str = "127.0.0.1",
        extra_clients: dict[str, tuple[str, tuple[str, ...]]] | None = None,
    ) -> None:
        """`nodes`: kwok's fake nodes (none: no kwok, real kubelets join instead). `address`: the
        one the API server listens on and advertises to the kubernetes Service (a real node's
        pods reach it there). `extra_clients`: more client certificates (pki.CLIENTS' form)."""
        self.workdir = workdir
        self.binaries = binaries
        self.nodes = nodes
        self.address = address
        self.extra_clients = extra_clients or {}
        self.logs = workdir / "logs"
        self.kubeconfig = workdir / "admin.kubeconfig"
        self.audit_log = self.logs / "audit.jsonl"
        self._audit_offset = 0
        self._audit: dict[str, dict[str, Any]] = {}
        self.components: list[Component] = []
        self.pki: pki.Pki | None = None
        self.server = ""
        self.startup_seconds = 0.0

    # -- lifecycle --------------------------------------------------------------------------

    def start(self, timeout: float = 90.0) -> None:
        """Start every component and return once the API server, the controllers, the scheduler
        and the fake nodes are ready. On failure, stops what started and raises with the logs."""
        started = time.monotonic()
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started

    def stop(self) -> None:
        """Stop the components in reverse order of start: the clients, the API server, etcd."""
        clients = [c for c in self.components if c.name not in ("kube-apiserver", "etcd")]
        for component in clients:
            if component.process.poll() is None:
                component.process.terminate()
        for component in reversed(self.components):
            component.stop()
        self.components.clear()

    def check_running(self) -> None:
        for component in self.components:
            component.check_running()

    # -- use --------------------------------------------------------------------------------

    @property
    def kubectl_binary(self) -> Path:
        """The kubectl built with the control plane, at the API server's version."""
        return self.binaries / "kubectl"

    def env(self) -> dict[str, str]:
        """The environment for running `kubectl` (or the operator) as the admin user. kubectl's
        discovery and HTTP cache is kept in the workdir: a run neither reads a stale one nor
        fills ~/.kube/cache."""
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "KUBECACHEDIR": str(self.workdir / "kube-cache"),
        }

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl as the admin user; with `check`, a failure raises with kubectl's stderr."""
        result = subprocess.run(
            [str(self.kubectl_binary), *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(),
        )
        if check and result.returncode != 0:
            raise KubectlError(
                f"kubectl {' '.join(args)} exited with {result.returncode}:\n{result.stderr}"
            )
        return result

    def get(self, *args: str) -> dict[str, Any]:
        """`kubectl get ARGS -o json`, parsed."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def write_token_kubeconfig(self, token: str, path: Path) -> Path:
        """A kubeconfig that authenticates with `token` alone (no client certificate)."""
        assert self.pki is not None
        _write_kubeconfig(path, self.server, self.pki.ca.cert, "token", {"token": token})
        return path

    def log_tails(self, lines: int = 40) -> str:
        return "\n\n".join(
            f"--- {c.name} ({c.log}) ---\n{tail(c.log, lines)}" for c in self.components
        )

    def audit_events(self, username: str | None = None) -> list[dict[str, Any]]:
        """Every audited request so far (one entry each, at the last stage it reached), in the
        order they arrived; only those of `username` if given."""
        if self.audit_log.exists():
            with self.audit_log.open("rb") as f:
                f.seek(self._audit_offset)
                data = f.read()
            complete = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
            self._audit_offset += len(complete)
            for line in complete.splitlines():
                if line.strip():
                    event = json.loads(line)
                    # A watch is logged twice (ResponseStarted, then ResponseComplete).
                    self._audit[event["auditID"]] = event
        return [
            event
            for event in self._audit.values()
            if username is None or event.get("user", {}).get("username") == username
        ]

    def rss_bytes(self) -> dict[str, int]:
        """Resident memory of each running component, by name."""
        return {c.name: c.rss_bytes() for c in self.components if c.process.poll() is None}

    # -- internals --------------------------------------------------------------------------

    def _start(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout

        def remaining() -> float:
            return max(deadline - time.monotonic(), 1.0)

        self.logs.mkdir(parents=True, exist_ok=True)
        self.pki = certs = pki.generate(
            self.workdir / "pki", (f"IP:{self.address}",), self.extra_clients
        )
        etcd_port, etcd_peer_port, apiserver_port, kcm_port, scheduler_port = (
            free_port() for _ in range(5)
        )
        self.server = f"https://{self.address}:{apiserver_port}"
        kubeconfigs = {}
        for name, pair in certs.clients.items():
            path = self.kubeconfig if name == "admin" else self.workdir / f"{name}.kubeconfig"
            _write_kubeconfig(
                path,
                self.server,
                certs.ca.cert,
                name,
                {"client-certificate": str(pair.cert), "client-key": str(pair.key)},
            )
            kubeconfigs[name] = path

        audit_policy = self.workdir / "audit-policy.yaml"
        audit_policy.write_text(yaml.safe_dump(AUDIT_POLICY))
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer_url = f"http://127.0.0.1:{etcd_peer_port}"
        self._spawn(
            "etcd",
            "--name=berth-test",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=berth-test={peer_url}",
            "--quota-backend-bytes=268435456",  # 256 MiB
            "--unsafe-no-fsync=true",  # throw-away data: no fsync, as envtest does
            "--heartbeat-interval=10",  # one member: elect it in tens of ms, not a second
            "--election-timeout=100",
            "--log-level=warn",
        )
        self._wait("etcd", lambda: http_ok(f"{etcd_url}/health"), remaining())

        # For `kubectl logs`, `exec` and `port-forward` through real kubelets, which check it.
        kubelet_client = certs.clients.get("apiserver-kubelet-client")
        kubelet_args = (
            [
                f"--kubelet-client-certificate={kubelet_client.cert}",
                f"--kubelet-client-key={kubelet_client.key}",
                f"--kubelet-certificate-authority={certs.ca.cert}",
                "--kubelet-preferred-address-types=InternalIP",
            ]
            if kubelet_client
            else []
        )
        loopback = self.address.startswith("127.")
        self._spawn(
            "kube-apiserver",
            f"--etcd-servers={etcd_url}",
            f"--bind-address={self.address}",
            f"--advertise-address={self.address}",
            *kubelet_args,
            f"--secure-port={apiserver_port}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={certs.apiserver.cert}",
            f"--tls-private-key-file={certs.apiserver.key}",
            f"--client-ca-file={certs.ca.cert}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={certs.sa_public_key}",
            f"--service-account-signing-key-file={certs.sa_private_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC",
            # Admission: the default plugins, PodSecurity among them (none is disabled here),
            # and owner references checked as strictly as on clusters that enable it: setting
            # blockOwnerDeletion needs `update` on the owner's finalizers.
            "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
            "--allow-privileged=true",  # as on a kubelet cluster; PodSecurity decides per namespace
            # On loopback the kubernetes Service gets no endpoints: not a valid address for one.
            f"--endpoint-reconciler-type={'none' if loopback else 'lease'}",
            "--profiling=false",
            f"--audit-policy-file={audit_policy}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json",
            "--audit-log-mode=blocking",  # written before the response: nothing lags
            "--audit-log-maxsize=0",
            f"--v={LOG_VERBOSITY}",
        )
        admin_tls = ssl.create_default_context(cafile=str(certs.ca.cert))
        admin_tls.load_cert_chain(str(certs.clients["admin"].cert), str(certs.clients["admin"].key))
        self._wait(
            "kube-apiserver", lambda: http_ok(f"{self.server}/readyz", admin_tls), remaining()
        )

        self._spawn(
            "kube-controller-manager",
            f"--kubeconfig={kubeconfigs['controller-manager']}",
            "--bind-address=127.0.0.1",
            f"--secure-port={kcm_port}",
            "--leader-elect=false",
            "--controllers=*",
            "--use-service-account-credentials=true",
            f"--root-ca-file={certs.ca.cert}",
            f"--service-account-private-key-file={certs.sa_private_key}",
            f"--cluster-signing-cert-file={certs.ca.cert}",
            f"--cluster-signing-key-file={certs.ca.key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # Else it creates /usr/libexec/kubernetes/kubelet-plugins/volume/exec/ on the host.
            f"--flex-volume-plugin-dir={self.workdir / 'flexvolume'}",
            # Each controller's ServiceAccount and token are made at start: at the default 20
            # requests/s that alone takes seconds.
            "--kube-api-qps=200",
            "--kube-api-burst=400",
            "--profiling=false",
            f"--v={LOG_VERBOSITY}",
        )
        scheduler_config = self.workdir / "kube-scheduler.yaml"
        scheduler_config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubescheduler.config.k8s.io/v1",
                    "kind": "KubeSchedulerConfiguration",
                    "clientConnection": {"kubeconfig": str(kubeconfigs["scheduler"])},
                    "leaderElection": {"leaderElect": False},
                    "enableProfiling": False,
                    "enableContentionProfiling": False,
                }
            )
        )
        self._spawn(
            "kube-scheduler",
            f"--config={scheduler_config}",
            "--bind-address=127.0.0.1",
            f"--secure-port={scheduler_port}",
            f"--v={LOG_VERBOSITY}",
        )
        annotation = "=".join(KWOK_NODE_ANNOTATION)
        if self.nodes:
            self._spawn(
                "kwok",
                f"--kubeconfig={kubeconfigs['kwok']}",
                # kwok also reads ~/.kwok/kwok.yaml if it exists: HOME is the workdir (see _spawn).
                f"--config={self.binaries / KWOK_STAGES}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={annotation}",
                f"--cidr={POD_CIDR}",
                "--node-lease-duration-seconds=40",
                "--v=WARN",
            )
            self._create_nodes()

        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE  # self-signed serving certificates of their own
        for name, port in (
            ("kube-controller-manager", kcm_port),
            ("kube-scheduler", scheduler_port),
        ):
            url = f"https://127.0.0.1:{port}/healthz"
            self._wait(name, lambda url=url: http_ok(url, insecure), remaining())
        # The controllers are at work once the ServiceAccount controller has made `default`.
        self._wait(
            "kube-controller-manager",
            lambda: self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0,
            remaining(),
            what="the default ServiceAccount (made by the controller-manager)",
        )
        if self.nodes:
            self._wait("kwok", self._nodes_ready, remaining(), what="the fake nodes to be Ready")

    def _spawn(self, name: str, *args: str) -> Component:
        log = self.logs / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [str(self.binaries / name), *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env={**os.environ, "HOME": str(self.workdir)},
                start_new_session=True,  # the terminal's Ctrl-C reaches pytest, which tears down
                preexec_fn=_die_with_parent,
            )
        component = Component(name, process, log)
        self.components.append(component)
        return component

    def _wait(self, name: str, ready: Callable[[], Any], timeout: float, what: str = "") -> None:
        component = next(c for c in self.components if c.name == name)

        def check() -> Any:
            component.check_running()
            return ready()

        try:
            wait_for(check, timeout, what=what or f"{name} to be ready", error=ControlPlaneError)
        except ControlPlaneError as error:
            every_log = f"(every component's log is in {self.logs})"
            if component.process.poll() is not None:
                raise ControlPlaneError(f"{error}\n{every_log}") from None
            log = tail(component.log)
            raise ControlPlaneError(
                f"{error}; the end of {component.log}:\n{log}\n{every_log}"
            ) from None

    def _create_nodes(self) -> None:
        key, value = KWOK_NODE_ANNOTATION
        items = [
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": node.name,
                    "annotations": {key: value},
                    "labels": {
                        "kubernetes.io/hostname": node.name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        "type": "kwok",
                        **node.labels,
                    },
                },
                # Status can be set on create: kwok keeps these and fills in the conditions.
                "status": {
                    "allocatable": dict(node.allocatable),
                    "capacity": dict(node.allocatable),
                    "addresses": [
                        {"type": "InternalIP", "address": node.ip},
                        {"type": "Hostname", "address": node.name},
                    ],
                },
            }
            for node in self.nodes
        ]
        self.kubectl(
            "create",
            "-f",
            "-",
            stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
        )

    def _nodes_ready(self) -> bool:
        result = self.kubectl("get", "nodes", "-o", "json", check=False)
        if result.returncode != 0:
            return False
        ready = {
            item["metadata"]["name"]
            for item in json.loads(result.stdout)["items"]
            for condition in item.get("status", {}).get("conditions", [])
            if condition["type"] == "Ready" and condition["status"] == "True"
        }
        return ready >= {node.name for node in self.nodes}


def _write_kubeconfig(
    path: Path, server: str, ca: Path, user: str, credentials: dict[str, str]
) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "berth-test", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": user, "context": {"cluster": "berth-test", "user": user}}],
        "current-context": user,
    }
    path.write_text(yaml.safe_dump(config))
    with contextlib.suppress(OSError):
        path.chmod(0o600)
