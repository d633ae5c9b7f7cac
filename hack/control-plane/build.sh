#!/usr/bin/env bash
# Build the control plane that tests/cluster/ runs, from source through the Go module proxy.
#
# kube-apiserver, kube-controller-manager, kube-scheduler and kubectl come from k8s.io/kubernetes,
# etcd from go.etcd.io/etcd/server/v3 and kwok (fake nodes) from sigs.k8s.io/kwok, at the versions
# pinned in versions.env. kubectl is built at the API server's version so that the tests never use
# whatever kubectl is on PATH (possibly outside the supported +-1 minor version skew). Next to them,
# kwok-stages.yaml: the Stages that kwokctl runs by default ("fast": nodes become Ready and keep a
# lease, pods become Running and Ready), taken from the same kwok release; the kwok binary alone
# starts with no Stage. All of it is cached under the user cache directory, keyed by those versions:
#
#   ${XDG_CACHE_HOME:-$HOME/.cache}/berth/control-plane/k8s-<v>_etcd-<v>_kwok-<v>/
#
# The directory is built next to its final place and renamed into it once complete, so it either
# holds every binary or does not exist. With every binary present this script does nothing; a
# directory that lacks one (made by an older build.sh, before kubectl was built) is rebuilt.
#
# usage: hack/control-plane/build.sh              build, or reuse the cache
#        hack/control-plane/build.sh --print-dir  print the cache directory (built or not)
#
# Go's own module cache and build cache (GOMODCACHE, GOCACHE) are used as configured.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
# shellcheck source=../lib/gobuild.sh
source "$here/../lib/gobuild.sh"

BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok)
# kwok's default "fast" Stages (kustomize/stage/fast in its module), without kustomize.
KWOK_STAGES=(
  node/fast/node-initialize.yaml
  node/heartbeat-with-lease/node-heartbeat-with-lease.yaml
  pod/fast/pod-ready.yaml
  pod/fast/pod-complete.yaml
  pod/fast/pod-delete.yaml
)
cache_root=${XDG_CACHE_HOME:-$HOME/.cache}/berth/control-plane
dest=$cache_root/k8s-${KUBERNETES_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}

cached() {
  local binary
  for binary in "${BINARIES[@]}"; do
    [[ -x $dest/$binary ]] || return 1
  done
  [[ -f $dest/kwok-stages.yaml ]]
}

begin_cached_build "control plane" "go" "$@"

# kube-apiserver, kube-controller-manager, kube-scheduler and kubectl.
step "k8s.io/kubernetes $KUBERNETES_VERSION: resolving modules"
kubernetes_module "$work/kubernetes" "$KUBERNETES_VERSION"
k8s_packages=()
for b in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
  k8s_packages+=("k8s.io/kubernetes/cmd/$b")
done
run "$work/get-kubernetes.log" go get "${k8s_packages[@]/%/@$KUBERNETES_VERSION}"
step "k8s.io/kubernetes $KUBERNETES_VERSION: building ${k8s_packages[*]##*/} (the long step)"
# One go build for the four: they share most of their compiled packages.
go build -trimpath -ldflags="$k8s_ldflags" -o "$bin/" "${k8s_packages[@]}"

step "go.etcd.io/etcd/server/v3 $ETCD_VERSION: building etcd"
src=$work/etcd
module "$src"
cd "$src"
run "$work/get-etcd.log" go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
go build -trimpath -ldflags="-s -w" -o "$bin/etcd" go.etcd.io/etcd/server/v3

step "sigs.k8s.io/kwok $KWOK_VERSION: building kwok"
src=$work/kwok
module "$src"
cd "$src"
run "$work/get-kwok.log" go get "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
go build -trimpath -ldflags="-s -w" -o "$bin/kwok" sigs.k8s.io/kwok/cmd/kwok
kwok_dir=$(go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
{
  echo "# kwok $KWOK_VERSION's default (fast) Stages, from its module's kustomize/stage/; see build.sh."
  for stage in "${KWOK_STAGES[@]}"; do
    echo "---"
    cat "$kwok_dir/kustomize/stage/$stage"
  done
} >"$bin/kwok-stages.yaml"

finish_cached_build "control plane" "$here/versions.env"
