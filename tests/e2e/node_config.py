"""The real node's names, addresses and configuration files (pure builders): the CNI network,
containerd's config, kubelet's and kube-proxy's configurations, CoreDNS's Corefile. node.py runs
the processes that read them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PREFIX = "berth-e2e"
NETNS = PREFIX
HOST_VETH, NODE_VETH = f"{PREFIX}-h", f"{PREFIX}-n"
# A /30 of the private range, unlikely to meet a real network on a test machine.
HOST_IP, NODE_IP = "10.250.250.1", "10.250.250.2"
POD_SUBNET, POD_GATEWAY = "10.244.0.0/24", "10.244.0.1"
BRIDGE = f"{PREFIX}0"
NODE_NAME = f"{PREFIX}-node"
CGROUP_ROOT = PREFIX
STATE_DIR = Path("/run") / PREFIX  # containerd's state and socket (tmpfs, as containerd expects)
CONTAINERD_SOCKET = STATE_DIR / "containerd.sock"
RUNC_ROOT = STATE_DIR / "runc"  # runc's state (the shim's default is /run/containerd/runc)
POD_LOGS_DIR = STATE_DIR / "pod-logs"  # kubelet's default is /var/log/pods
CNI_BIN_DIR = "/usr/lib/cni"  # Debian's containernetworking-plugins
RUNC = "/usr/sbin/runc"  # Debian's runc
SANDBOX_IMAGE = "berth.local/pause:e2e"
CLUSTER_DOMAIN = "cluster.local"
# Client certificates for the node's components (pki.CLIENTS' form: name -> (user, groups)).
NODE_CLIENTS = {
    "kubelet": (f"system:node:{NODE_NAME}", ("system:nodes",)),
    "kube-proxy": ("system:kube-proxy", ()),
    "coredns": ("berth-e2e-coredns", ("system:masters",)),
    "apiserver-kubelet-client": ("kube-apiserver-kubelet-client", ("system:masters",)),
}


def cni_conflist(ipam_dir: Path) -> str:
    """The pods' network: a bridge on POD_SUBNET, no masquerade (nothing leaves the machine)."""
    return json.dumps(
        {
            "cniVersion": "1.0.0",
            "name": PREFIX,
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,  # a pod reaches itself through a Service
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_SUBNET, "gateway": POD_GATEWAY}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(ipam_dir),
                    },
                },
                {"type": "loopback"},
            ],
        },
        indent=2,
    )


def containerd_toml(root: Path, opt_dir: Path, cni_dir: Path) -> str:
    runtime = "plugins.'io.containerd.cri.v1.runtime'"
    return f"""version = 3
root = '{root}'
state = '{STATE_DIR / "containerd"}'
imports = []
disabled_plugins = ['io.containerd.nri.v1.nri', 'io.containerd.internal.v1.tracing']

[grpc]
  address = '{CONTAINERD_SOCKET}'

[plugins.'io.containerd.internal.v1.opt']
  path = '{opt_dir}'

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '{SANDBOX_IMAGE}'

[{runtime}]
  # No CAP_SYS_RESOURCE on this host: runc may only raise a process's OOM score.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_cdi = false
  [{runtime}.containerd.runtimes.runc]
    runtime_type = 'io.containerd.runc.v2'
    [{runtime}.containerd.runtimes.runc.options]
      BinaryName = '{RUNC}'
      Root = '{RUNC_ROOT}'
      SystemdCgroup = false
  [{runtime}.cni]
    bin_dirs = ['{CNI_BIN_DIR}']
    conf_dir = '{cni_dir}'
"""


def kubelet_config(ca: Path, cert: Path, key: Path, resolv_conf: Path) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # this host runs cgroup v1
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{CGROUP_ROOT}",
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
        "address": NODE_IP,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "tlsCertFile": str(cert),
        "tlsPrivateKeyFile": str(key),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca)},
        },
        "authorization": {"mode": "Webhook"},
        "clusterDNS": [NODE_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(resolv_conf),
        "podLogsDir": str(POD_LOGS_DIR),
        "failSwapOn": False,
        # Images are imported, never pulled: never collect them, never evict for disk.
        "imageGCHighThresholdPercent": 100,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
        },
        "serializeImagePulls": False,
        "protectKernelDefaults": False,
        "nodeStatusUpdateFrequency": "5s",
        "syncFrequency": "10s",
    }


def kube_proxy_config(kubeconfig: Path) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": NODE_NAME,
        "clusterCIDR": POD_SUBNET,
        "bindAddress": NODE_IP,
        "nodePortAddresses": ["primary"],
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        # Leave the host's conntrack table size alone (a namespace cannot set it anyway).
        "conntrack": {"maxPerCore": 0, "min": 0},
    }


def corefile(kubeconfig: Path) -> str:
    """cluster.local on NODE_IP; no upstream to forward other names to."""
    return f""".:53 {{
    bind {NODE_IP}
    errors
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} coredns
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
"""
