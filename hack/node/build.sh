#!/usr/bin/env bash
# Build the real node that `make e2e` runs, from source through the Go module proxy.
#
# kubelet and kube-proxy come from k8s.io/kubernetes at the control plane's version
# (hack/control-plane/versions.env); containerd, its runc shim and ctr (which imports the images)
# from github.com/containerd/containerd/v2; CoreDNS, with only the plugins of coredns/main.go,
# from github.com/coredns/coredns; those two at the versions in versions.env. pause, the pod
# sandbox's process, is Kubernetes' own pause.c from the same module, linked statically (no
# registry holds its image here). runc and the CNI plugins come from
# Debian's packages (hack/e2e/host.sh installs them). All of it is cached, keyed by the versions:
#
#   ${XDG_CACHE_HOME:-$HOME/.cache}/berth/node/k8s-<v>_containerd-<v>_coredns-<v>/
#
# built next to its final place and renamed into it once complete, as hack/control-plane/build.sh
# does.
#
# usage: hack/node/build.sh              build, or reuse the cache
#        hack/node/build.sh --print-dir  print the cache directory (built or not)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../control-plane/versions.env
source "$here/../control-plane/versions.env"
# shellcheck source=versions.env
source "$here/versions.env"
# shellcheck source=../lib/gobuild.sh
source "$here/../lib/gobuild.sh"

BINARIES=(kubelet kube-proxy containerd containerd-shim-runc-v2 ctr coredns pause)
cache_root=${XDG_CACHE_HOME:-$HOME/.cache}/berth/node
dest=$cache_root/k8s-${KUBERNETES_VERSION}_containerd-${CONTAINERD_VERSION}_coredns-${COREDNS_VERSION}

cached() {
  local binary
  for binary in "${BINARIES[@]}"; do
    [[ -x $dest/$binary ]] || return 1
  done
}

begin_cached_build "node" "go gcc" "$@"

step "k8s.io/kubernetes $KUBERNETES_VERSION: resolving modules"
kubernetes_module "$work/kubernetes" "$KUBERNETES_VERSION"
run "$work/get-kubernetes.log" go get \
  "k8s.io/kubernetes/cmd/kubelet@$KUBERNETES_VERSION" "k8s.io/kubernetes/cmd/kube-proxy@$KUBERNETES_VERSION"
step "k8s.io/kubernetes $KUBERNETES_VERSION: building kubelet and kube-proxy (the long step)"
go build -trimpath -ldflags="$k8s_ldflags" -o "$bin/" \
  k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy
# pause: the sandbox process, from the same module's build/pause/linux/pause.c.
pause_source=$(go list -m -f '{{.Dir}}' k8s.io/kubernetes)/build/pause/linux/pause.c
gcc -Os -static -DVERSION="berth-e2e-$KUBERNETES_VERSION" -o "$bin/pause" "$pause_source"
strip "$bin/pause"

step "github.com/containerd/containerd/v2 $CONTAINERD_VERSION: building containerd, its runc shim and ctr"
module "$work/containerd"
cd "$work/containerd"
run "$work/get-containerd.log" go get \
  "github.com/containerd/containerd/v2/cmd/containerd@$CONTAINERD_VERSION" \
  "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION" \
  "github.com/containerd/containerd/v2/cmd/ctr@$CONTAINERD_VERSION"
# The storage drivers this host has no use for need cgo or kernel headers.
go build -trimpath -tags no_btrfs,no_devmapper,no_zfs \
  -ldflags="-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION" \
  -o "$bin/" github.com/containerd/containerd/v2/cmd/containerd \
  github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
  github.com/containerd/containerd/v2/cmd/ctr

step "github.com/coredns/coredns $COREDNS_VERSION: building coredns (coredns/main.go's plugins)"
module "$work/coredns"
cp "$here/coredns/main.go" "$work/coredns/"
cd "$work/coredns"
run "$work/get-coredns.log" go get "github.com/coredns/coredns@$COREDNS_VERSION"
run "$work/tidy-coredns.log" go mod tidy
go build -trimpath -ldflags="-s -w" -o "$bin/coredns" .

finish_cached_build "node" "$here/versions.env"
