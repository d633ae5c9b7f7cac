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

if [[ ${1-} == --print-dir ]]; then
  echo "$dest"
  exit 0
elif [[ $# -gt 0 ]]; then
  echo "usage: $0 [--print-dir]" >&2
  exit 2
fi

cached() {
  local binary
  for binary in "${BINARIES[@]}"; do
    [[ -x $dest/$binary ]] || return 1
  done
  [[ -f $dest/kwok-stages.yaml ]]
}

if cached; then
  echo "control plane: cached in $dest"
  exit 0
fi

command -v go >/dev/null || {
  echo "build.sh: go is not on PATH; the control plane is built from source with Go (>= 1.26)" >&2
  exit 1
}

mkdir -p "$cache_root"
work=$(mktemp -d "$cache_root/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT
trap 'echo "build.sh: FAILED (see the error above); nothing was cached" >&2' ERR
bin=$work/bin
mkdir -p "$bin"
export CGO_ENABLED=0
started=$SECONDS

# run LOG CMD...: run a noisy go command; its whole output is shown only if it fails.
run() {
  local log=$1
  shift
  if ! "$@" >"$log" 2>&1; then
    cat "$log" >&2
    echo "build.sh: failed: $*" >&2
    return 1
  fi
}

# module DIR: an empty Go module of ours to build others' main packages from.
module() {
  mkdir -p "$1"
  printf 'module berth.test/control-plane/%s\n\ngo 1.26\n' "$(basename "$1")" >"$1/go.mod"
}

step() { echo "==> $* ($((SECONDS - started)) s)"; }

# kube-apiserver, kube-controller-manager, kube-scheduler and kubectl. k8s.io/kubernetes's go.mod
# replaces every k8s.io/* staging module with ./staging/src/k8s.io/<name>, which only works inside
# its own repository; a consumer replaces each with its published release, v0.<minor>.<patch> for
# v1.<minor>.<patch>.
step "k8s.io/kubernetes $KUBERNETES_VERSION: resolving modules"
src=$work/kubernetes
module "$src"
cd "$src"
staging_version=v0.${KUBERNETES_VERSION#v1.}
# On failure, Go's JSON answer carries the proxy's exact error ("Error": ...).
if ! info=$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" 2>&1); then
  echo "$info" >&2
  echo "build.sh: failed: go mod download k8s.io/kubernetes@$KUBERNETES_VERSION" >&2
  false
fi
gomod=$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p' <<<"$info")
[[ -f $gomod ]] || {
  echo "build.sh: no go.mod for k8s.io/kubernetes@$KUBERNETES_VERSION in: $info" >&2
  false
}
staging=$(sed -n 's#^[[:space:]]*\(k8s\.io/[^ ]*\) => \./staging/src/.*#\1#p' "$gomod")
[[ -n $staging ]] || {
  echo "build.sh: found no staging replace directives in $gomod" >&2
  false
}
edits=()
for m in $staging; do
  edits+=("-replace=$m=$m@$staging_version")
done
go mod edit "${edits[@]}"
k8s_packages=()
for b in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
  k8s_packages+=("k8s.io/kubernetes/cmd/$b")
done
run "$work/get-kubernetes.log" go get "${k8s_packages[@]/%/@$KUBERNETES_VERSION}"
# The version the binaries report, as Kubernetes' own build sets it (hack/lib/version.sh).
minor=${KUBERNETES_VERSION#v1.}
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1"
  ldflags+=" -X $pkg.gitMinor=${minor%%.*} -X $pkg.gitTreeState=clean"
done
step "k8s.io/kubernetes $KUBERNETES_VERSION: building ${k8s_packages[*]##*/} (the long step)"
# One go build for the four: they share most of their compiled packages.
go build -trimpath -ldflags="$ldflags" -o "$bin/" "${k8s_packages[@]}"

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

for binary in "${BINARIES[@]}"; do
  [[ -x $bin/$binary ]] || {
    echo "build.sh: $binary was not built" >&2
    false
  }
done
cp "$here/versions.env" "$bin/versions.env"
# An incomplete directory in the way (an interrupted copy, an older layout) is replaced.
if [[ -e $dest ]] && ! cached; then
  mv -T "$dest" "$work/stale"
fi
if ! mv -T "$bin" "$dest" 2>/dev/null; then
  cached || {
    echo "build.sh: could not move $bin to $dest" >&2
    false
  }
  echo "control plane: another build finished first; using it"
fi
step "control plane: built in $dest"
