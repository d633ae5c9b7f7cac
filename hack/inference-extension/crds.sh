#!/usr/bin/env bash
# Fetch the Gateway API Inference Extension's InferencePool CRD (inference.networking.k8s.io/v1)
# that tests/cluster/ installs, from the extension's own Go module through the Go module proxy, at
# the version pinned in versions.env. Cached under the user cache directory, keyed by version:
#
#   ${XDG_CACHE_HOME:-$HOME/.cache}/berth/inference-extension-<v>/inferencepools.yaml
#
# usage: hack/inference-extension/crds.sh              fetch, or reuse the cache
#        hack/inference-extension/crds.sh --print-dir  print the cache directory (fetched or not)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
# shellcheck source=../lib/gobuild.sh
source "$here/../lib/gobuild.sh"

MODULE=sigs.k8s.io/gateway-api-inference-extension
CRD=config/crd/bases/inference.networking.k8s.io_inferencepools.yaml
BINARIES=()
dest=${XDG_CACHE_HOME:-$HOME/.cache}/berth/inference-extension-$INFERENCE_EXTENSION_VERSION

cached() { [[ -f $dest/inferencepools.yaml ]]; }

begin_cached_build "InferencePool CRD" "go" "$@"

step "$MODULE $INFERENCE_EXTENSION_VERSION: downloading the module"
cd "$work"
if ! info=$(go mod download -json "$MODULE@$INFERENCE_EXTENSION_VERSION" 2>&1); then
  echo "$info" >&2
  echo "${0##*/}: failed: go mod download $MODULE@$INFERENCE_EXTENSION_VERSION" >&2
  exit 1
fi
dir=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$info")
[[ -f $dir/$CRD ]] || {
  echo "${0##*/}: $CRD is not in $MODULE@$INFERENCE_EXTENSION_VERSION ($dir)" >&2
  exit 1
}
{
  echo "# $MODULE $INFERENCE_EXTENSION_VERSION: $CRD (fetched by hack/inference-extension/crds.sh)"
  cat "$dir/$CRD"
} >"$bin/inferencepools.yaml"
finish_cached_build "InferencePool CRD" "$here/versions.env"
