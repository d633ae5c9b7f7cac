"""A real Kubernetes node for tests/e2e: containerd, kubelet, kube-proxy and CoreDNS in a network
namespace of their own, joined to the tests' control plane (tests/cluster/controlplane.py).

The binaries come from `hack/node/build.sh` (cached by version), runc and the CNI plugins from
Debian's packages, the images from `hack/e2e/images.sh` (tarballs that containerd imports here).

The network: a veth pair joins the host (HOST_IP, where the API server listens) to the namespace
(NODE_IP, the node's address: kubelet refuses a loopback one). Inside, the CNI bridge plugin puts
pods on POD_SUBNET with no masquerade, and the namespace routes only to the host's end of the veth,
so nothing a pod sends can leave this machine. kube-proxy's iptables rules live in the namespace
too. CoreDNS serves cluster.local on NODE_IP, the pods' nameserver.

What this host needs, and why: kubelet runs on cgroup v1 (`failCgroupV1: false`), under a cgroup
root of its own; containerd has `restrict_oom_score_adj` (no CAP_SYS_RESOURCE here: runc cannot
lower a score) and keeps pod network namespaces under its state directory.

Everything made is named after PREFIX, so `sweep()` can remove what an earlier run left (a killed
test process cannot clean up after itself): the processes, mounts, the network namespace (with
the veth, the bridge and every iptables rule), the cgroups and the state directory. `stop()` ends
in the same sweep.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import yaml

from tests.cluster import pki
from tests.cluster.controlplane import (
    Component,
    ControlPlane,
    ControlPlaneError,
    _die_with_parent,
    tail,
)
from tests.e2e import node_config as cfg
from tests.e2e.node_config import (
    CGROUP_ROOT,
    CONTAINERD_SOCKET,
    HOST_IP,
    HOST_VETH,
    NETNS,
    NODE_IP,
    NODE_NAME,
    NODE_VETH,
    POD_LOGS_DIR,
    POD_SUBNET,
    PREFIX,
    STATE_DIR,
)
from tests.helpers import wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
NODE_BUILD = REPO_ROOT / "hack" / "node" / "build.sh"
NODE_BINARIES = ("kubelet", "kube-proxy", "containerd", "containerd-shim-runc-v2", "ctr", "coredns")


class NodeError(ControlPlaneError):
    """The node could not be set up; the message says what, with the log that tells why."""


def node_binaries_dir() -> Path:
    result = subprocess.run(
        [str(NODE_BUILD), "--print-dir"], capture_output=True, text=True, check=True
    )
    directory = Path(result.stdout.strip())
    missing = [name for name in NODE_BINARIES if not (directory / name).is_file()]
    if missing:
        raise NodeError(
            f"the node is not built: {', '.join(missing)} missing in {directory}; "
            "`make e2e` builds it (hack/node/build.sh)"
        )
    return directory


def sh(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise NodeError(f"{' '.join(args)} exited with {result.returncode}: {result.stderr}")
    return result


def in_netns(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return sh("ip", "netns", "exec", NETNS, *args, check=check)


class Node:
    """One real node: `create_network()` first (the API server listens on HOST_IP), then the
    control plane `plane` (started with address=HOST_IP and NODE_CLIENTS), then `start()`."""

    def __init__(self, workdir: Path, binaries: Path, plane: ControlPlane, images: Path) -> None:
        self.workdir = workdir
        self.binaries = binaries
        self.plane = plane
        self.images = images
        self.logs = workdir / "logs"
        self.components: list[Component] = []

    # -- lifecycle --------------------------------------------------------------------------

    def create_network(self) -> None:
        """Sweep what an earlier, killed run left, then make the namespace and the veth."""
        sweep(self.workdir)
        try:
            self._network()
        except BaseException:
            sweep(self.workdir)
            raise

    def start(self, timeout: float = 240.0) -> None:
        """Network, containerd (with the images imported), kubelet, kube-proxy and CoreDNS; returns
        once the Node is Ready. On failure, stops what started and raises with the logs."""
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for component in reversed(self.components):
            component.stop()
        self.components.clear()
        sweep(self.workdir)
        # The imported images, unpacked: over ten GB that pytest's kept temporary directories
        # would otherwise hold on to.
        shutil.rmtree(self.workdir / "containerd", ignore_errors=True)

    def check_running(self) -> None:
        for component in self.components:
            component.check_running()

    def log_tails(self, lines: int = 30) -> str:
        return "\n\n".join(
            f"--- {c.name} ({c.log}) ---\n{tail(c.log, lines)}" for c in self.components
        )

    def ctr(
        self, *args: str, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        ctr = str(self.binaries / "ctr")
        return sh(
            ctr,
            f"--address={CONTAINERD_SOCKET}",
            "--namespace=k8s.io",
            *args,
            check=check,
            timeout=timeout,
        )

    # -- internals --------------------------------------------------------------------------

    def _start(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self.logs.mkdir(parents=True, exist_ok=True)
        for controller in cgroup_controllers():
            (controller / CGROUP_ROOT).mkdir(exist_ok=True)
        self._containerd()
        self._import_images()
        self._kubelet()
        self._kube_proxy()
        self._coredns()
        wait_for(
            self._ready,
            max(deadline - time.monotonic(), 1.0),
            interval=1,
            what=f"node {NODE_NAME} to be Ready",
            error=NodeError,
        )

    def _network(self) -> None:
        sh("ip", "netns", "add", NETNS)
        sh("ip", "link", "add", HOST_VETH, "type", "veth", "peer", "name", NODE_VETH)
        sh("ip", "link", "set", NODE_VETH, "netns", NETNS)
        sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", HOST_VETH)
        sh("ip", "link", "set", HOST_VETH, "up")
        # The host answers pods (the operator's API calls) through the node: without this
        # route the replies would take the host's default route out of the machine.
        sh("ip", "route", "add", POD_SUBNET, "via", NODE_IP, "dev", HOST_VETH)
        in_netns("ip", "addr", "add", f"{NODE_IP}/30", "dev", NODE_VETH)
        in_netns("ip", "link", "set", NODE_VETH, "up")
        in_netns("ip", "link", "set", "lo", "up")
        # Routing between the bridge and the veth; no default route, on purpose.
        in_netns("sysctl", "-qw", "net.ipv4.ip_forward=1")
        # Service traffic between two pods on the bridge goes through kube-proxy's rules.
        in_netns("sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1", check=False)
        cni = self.workdir / "cni"
        cni.mkdir(parents=True, exist_ok=True)
        (cni / f"10-{PREFIX}.conflist").write_text(cfg.cni_conflist(self.workdir / "cni-ipam"))

    def _containerd(self) -> None:
        config = self.workdir / "containerd.toml"
        config.write_text(
            cfg.containerd_toml(
                self.workdir / "containerd", self.workdir / "containerd-opt", self.workdir / "cni"
            )
        )
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        # The shim is found on PATH, next to containerd.
        self._spawn("containerd", "--config", str(config), path=str(self.binaries))

        def answers() -> bool:
            self.check_running()
            return self.ctr("version", check=False).returncode == 0

        wait_for(answers, 60, what="containerd to answer", error=NodeError)

    def _import_images(self) -> None:
        tarballs = sorted(self.images.glob("*.tar"))
        if not tarballs:
            raise NodeError(f"no image tarballs in {self.images}: hack/e2e/images.sh makes them")
        for tarball in tarballs:
            self.ctr("images", "import", "--local", str(tarball))

    def _kubelet(self) -> None:
        assert self.plane.pki is not None
        serving = pki.serving_certificate(
            self.plane.workdir / "pki", "kubelet-serving", (f"IP:{NODE_IP}", f"DNS:{NODE_NAME}")
        )
        resolv = self.workdir / "resolv.conf"
        resolv.write_text(f"nameserver {NODE_IP}\n")
        config = self.workdir / "kubelet.yaml"
        config.write_text(
            yaml.safe_dump(
                cfg.kubelet_config(self.plane.pki.ca.cert, serving.cert, serving.key, resolv)
            )
        )
        self._spawn(
            "kubelet",
            f"--config={config}",
            f"--kubeconfig={self.plane.workdir / 'kubelet.kubeconfig'}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={NODE_IP}",
            f"--root-dir={self.workdir / 'kubelet'}",
            f"--cert-dir={self.workdir / 'kubelet-pki'}",
            "--v=1",
        )

    def _kube_proxy(self) -> None:
        config = self.workdir / "kube-proxy.yaml"
        kubeconfig = self.plane.workdir / "kube-proxy.kubeconfig"
        config.write_text(yaml.safe_dump(cfg.kube_proxy_config(kubeconfig)))
        self._spawn("kube-proxy", f"--config={config}", "--v=1")

    def _coredns(self) -> None:
        corefile = self.workdir / "Corefile"
        corefile.write_text(cfg.corefile(self.plane.workdir / "coredns.kubeconfig"))
        self._spawn("coredns", "-conf", str(corefile))

    def _spawn(self, name: str, *args: str, path: str | None = None) -> Component:
        log = self.logs / f"{name}.log"
        env = {**os.environ, "HOME": str(self.workdir)}
        if path:
            env["PATH"] = f"{path}:{env['PATH']}"
        with log.open("wb") as out:
            process = subprocess.Popen(
                # nsenter switches the network namespace only: kubelet's volume mounts must stay
                # visible to containerd (`ip netns exec` would give each its own mount namespace).
                ["nsenter", f"--net=/run/netns/{NETNS}", str(self.binaries / name), *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        component = Component(name, process, log)
        self.components.append(component)
        return component

    def _ready(self) -> bool:
        self.check_running()
        result = self.plane.kubectl("get", "node", NODE_NAME, "-o", "json", check=False)
        if result.returncode != 0:
            return False
        node = yaml.safe_load(result.stdout)
        return any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in node.get("status", {}).get("conditions", [])
        )


def cgroup_controllers() -> list[Path]:
    """The cgroup v1 hierarchies kubelet uses (each mounted controller directory)."""
    root = Path("/sys/fs/cgroup")
    return [p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and p.name != "unified"]


def sweep(workdir: Path | None = None) -> None:
    """Remove every trace of a node: processes, mounts, the network namespace (its veth, bridge
    and iptables rules go with it), the cgroups, containerd's state. Safe when nothing is left."""
    # Pods' processes (in our cgroups), the shims and the node's components (in our network
    # namespace), killed outright: a graceful stop is stop()'s job, before this.
    pids: set[int] = set()
    for controller in cgroup_controllers():
        for procs in (controller / CGROUP_ROOT).rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in procs.read_text().split())
    if Path(f"/run/netns/{NETNS}").exists():  # the node's components and containerd's shims
        pids.update(int(p) for p in sh("ip", "netns", "pids", NETNS, check=False).stdout.split())
    pids.discard(os.getpid())
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _wait_gone(pids)
    # Mounts: pod volumes and rootfs, containerd's pod netns files, the node's netns file.
    roots = [str(STATE_DIR), f"/run/netns/{NETNS}"]
    if workdir is not None:
        roots.append(str(workdir))
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for mount in sorted(mounts, key=len, reverse=True):  # deepest first
        if any(mount == r or mount.startswith(r.rstrip("/") + "/") for r in roots):
            sh("umount", "-l", mount, check=False)
    if Path(f"/run/netns/{NETNS}").exists() or NETNS in sh("ip", "netns", "list").stdout.split():
        sh("ip", "netns", "delete", NETNS, check=False)
    sh("ip", "link", "delete", HOST_VETH, check=False)  # gone with the namespace, normally
    for controller in cgroup_controllers():
        top = controller / CGROUP_ROOT
        if top.is_dir():
            for cgroup in sorted(top.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                if cgroup.is_dir():
                    with contextlib.suppress(OSError):
                        cgroup.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()
    sh("rm", "-rf", str(STATE_DIR), check=False)
    _sweep_fixed_paths()


def _sweep_fixed_paths() -> None:
    """What kubelet, containerd's shims and the CNI library write to fixed host paths whatever
    their configuration says, once no other kubelet or containerd runs to own it."""
    others = [
        p
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and _comm(p) in ("kubelet", "containerd", "containerd-shim")
    ]
    if others:
        return
    # kubelet: /var/log/containers holds links into its (moved) pod log directory.
    containers = Path("/var/log/containers")
    if containers.is_dir():
        for link in containers.iterdir():
            with contextlib.suppress(OSError):
                if str(os.readlink(link)).startswith(str(POD_LOGS_DIR)):
                    link.unlink()
    # kubelet's device plugin socket and checkpoint; the shims' sockets; the CNI result cache.
    plugins = Path("/var/lib/kubelet/device-plugins")
    for name in ("kubelet.sock", "kubelet_internal_checkpoint"):
        with contextlib.suppress(OSError):
            (plugins / name).unlink()
    shim_sockets = Path("/run/containerd/s")
    if shim_sockets.is_dir():
        for socket in shim_sockets.iterdir():
            with contextlib.suppress(OSError):
                socket.unlink()
    results = Path("/var/lib/cni/results")
    if results.is_dir():
        ours = {
            f.name.removeprefix(f"{PREFIX}-").rsplit("-", 1)[0] for f in results.glob(f"{PREFIX}-*")
        }
        for result in results.iterdir():
            if result.name.startswith(f"{PREFIX}-") or any(i in result.name for i in ours):
                with contextlib.suppress(OSError):
                    result.unlink()
    for directory in (
        containers,
        plugins,
        plugins.parent,
        shim_sockets,
        shim_sockets.parent,
        results,
        results.parent,
    ):
        with contextlib.suppress(OSError):
            directory.rmdir()  # only once empty: a directory the host used before stays


def _comm(proc: Path) -> str:
    try:
        return (proc / "comm").read_text().strip()
    except OSError:
        return ""


def _wait_gone(pids: set[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        pids = {p for p in pids if Path(f"/proc/{p}").exists()}
        time.sleep(0.1)
