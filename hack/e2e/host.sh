#!/usr/bin/env bash
# What `make e2e` needs of the host beyond the Go and C toolchains: Debian's packages for the
# image builds (docker.io's dockerd, debootstrap) and the node (runc, the CNI plugins, iptables and
# conntrack for kube-proxy; nsenter and ip come with util-linux and iproute2). Installs the missing
# ones with apt-get; root only (the node needs root anyway).
set -euo pipefail

packages=(docker.io runc debootstrap containernetworking-plugins iptables conntrack iproute2 util-linux)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$package")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "host.sh: the e2e tests run a kubelet and containerd, as root; missing: ${missing[*]}" >&2
  exit 1
fi
echo "==> apt-get install ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
