# Shared by the build scripts under hack/ that build others' Go programs from the Go module proxy
# into a cache directory (sourced, not run).

# begin_cached_build WHAT TOOLS ARGS...: the start of such a script, which sets `dest` (the cache
# directory) and defines `cached` (every file is there) first. `--print-dir` prints `dest` and
# exits; a complete cache is reused (exit); otherwise the TOOLS (space-separated) must be on PATH,
# and `work` (a scratch directory next to `dest`, removed at exit), `bin` (in it) and `started`
# are set.
begin_cached_build() {
  local what=$1 tools=$2 tool
  shift 2
  if [[ ${1-} == --print-dir ]]; then
    echo "$dest"
    exit 0
  elif [[ $# -gt 0 ]]; then
    echo "usage: $0 [--print-dir]" >&2
    exit 2
  fi
  if cached; then
    echo "$what: cached in $dest"
    exit 0
  fi
  for tool in $tools; do
    command -v "$tool" >/dev/null || {
      echo "${0##*/}: $tool is not on PATH; the $what is built from source with: $tools" >&2
      exit 1
    }
  done
  mkdir -p "$(dirname "$dest")"
  work=$(mktemp -d "$(dirname "$dest")/.build.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  trap 'echo "${0##*/}: FAILED (see the error above); nothing was cached" >&2' ERR
  bin=$work/bin
  mkdir -p "$bin"
  export CGO_ENABLED=0
  started=$SECONDS
}

# run LOG CMD...: run a noisy go command; its whole output is shown only if it fails.
run() {
  local log=$1
  shift
  if ! "$@" >"$log" 2>&1; then
    cat "$log" >&2
    echo "${0##*/}: failed: $*" >&2
    return 1
  fi
}

# module DIR: an empty Go module of ours to build others' main packages from.
module() {
  mkdir -p "$1"
  printf 'module berth.test/build/%s\n\ngo 1.26\n' "$(basename "$1")" >"$1/go.mod"
}

step() { echo "==> $* ($((SECONDS - started)) s)"; }

# kubernetes_module DIR VERSION: make DIR a module that can build k8s.io/kubernetes@VERSION's
# commands, and set `k8s_ldflags` to the version stamp Kubernetes' own build sets
# (hack/lib/version.sh). k8s.io/kubernetes's go.mod replaces every k8s.io/* staging module with
# ./staging/src/k8s.io/<name>, which only works inside its own repository; a consumer replaces
# each with its published release, v0.<minor>.<patch> for v1.<minor>.<patch>.
kubernetes_module() {
  local dir=$1 version=$2 info gomod staging m minor pkg
  module "$dir"
  cd "$dir"
  # On failure, Go's JSON answer carries the proxy's exact error ("Error": ...).
  if ! info=$(go mod download -json "k8s.io/kubernetes@$version" 2>&1); then
    echo "$info" >&2
    echo "${0##*/}: failed: go mod download k8s.io/kubernetes@$version" >&2
    return 1
  fi
  gomod=$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p' <<<"$info")
  [[ -f $gomod ]] || {
    echo "${0##*/}: no go.mod for k8s.io/kubernetes@$version in: $info" >&2
    return 1
  }
  staging=$(sed -n 's#^[[:space:]]*\(k8s\.io/[^ ]*\) => \./staging/src/.*#\1#p' "$gomod")
  [[ -n $staging ]] || {
    echo "${0##*/}: found no staging replace directives in $gomod" >&2
    return 1
  }
  local edits=()
  for m in $staging; do
    edits+=("-replace=$m=$m@v0.${version#v1.}")
  done
  go mod edit "${edits[@]}"
  minor=${version#v1.}
  k8s_ldflags="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    k8s_ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=1"
    k8s_ldflags+=" -X $pkg.gitMinor=${minor%%.*} -X $pkg.gitTreeState=clean"
  done
}

# finish_cached_build WHAT VERSIONS_FILE: check that every one of the caller's BINARIES was built
# into `bin`, put VERSIONS_FILE beside them, and move the complete directory into `dest`
# (replacing an incomplete one in the way), so that `dest` holds every file or does not exist.
finish_cached_build() {
  local what=$1 versions=$2 binary
  for binary in "${BINARIES[@]}"; do
    [[ -x $bin/$binary ]] || {
      echo "${0##*/}: $binary was not built" >&2
      return 1
    }
  done
  cp "$versions" "$bin/versions.env"
  if [[ -e $dest ]] && ! cached; then
    mv -T "$dest" "$work/stale"
  fi
  if ! mv -T "$bin" "$dest" 2>/dev/null; then
    cached || {
      echo "${0##*/}: could not move $bin to $dest" >&2
      return 1
    }
    echo "${0##*/}: another build finished first; using it"
  fi
  step "$what: built in $dest"
}
