#!/usr/bin/env bash
# Build the three images `make e2e` runs (runtime CPU, router, operator) and the pod sandbox
# image, from this checkout's Dockerfile, with no registry: a dockerd of its own (Debian's
# docker.io) builds them, the base is hack/e2e/base-image.sh's debootstrap under the Dockerfile's
# FROM name, Python is the base's own, and every wheel comes from the host's wheelhouse
# (hack/e2e/wheelhouse.py); only Debian's apt mirror is reached, for python3 and g++.
#
# Each image is saved as a tarball for containerd to import (tests/e2e/node.py):
#
#   ${XDG_CACHE_HOME:-$HOME/.cache}/berth/e2e/images/<name>.tar   (and <name>.id: its image ID)
#
# dockerd keeps its data (the layer cache) under the same directory, so an unchanged layer is not
# built twice; it runs only while this script does, with no bridge and no iptables rules (builds
# use the host's network). A tarball is rewritten only when its image changed.
#
# usage: hack/e2e/images.sh
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/berth/e2e
out=$cache/images
run=/run/berth-images-docker
python=${PYTHON:-python3}
# Debian's docker 20.10 client: it drives BuildKit without the buildx plugin.
docker=/usr/bin/docker
export DOCKER_HOST=unix://$run/docker.sock DOCKER_BUILDKIT=1
started=$SECONDS
step() { echo "==> $* ($((SECONDS - started)) s)"; }

for tool in dockerd "$docker"; do
  command -v "$tool" >/dev/null || {
    echo "images.sh: $tool is missing (hack/e2e/host.sh installs Debian's docker.io)" >&2
    exit 1
  }
done
base_tar=$("$here/base-image.sh")
wheelhouse=$("$python" "$here/wheelhouse.py")
node_dir=$("$repo/hack/node/build.sh" --print-dir)
[[ -x $node_dir/pause ]] || {
  echo "images.sh: no pause binary in $node_dir: run hack/node/build.sh first" >&2
  exit 1
}
mkdir -p "$out"

context=$repo/.wheelhouse
# dockerd's own containerd makes /opt/containerd (empty) unless it is there already.
[[ -e /opt/containerd ]] && had_opt=1 || had_opt=0
# stop_dockerd: the dockerd of this script (or of one killed before it could clean up) and the
# containerd it runs, found by their state directories under $run.
stop_dockerd() {
  local pids
  if [[ -f $run/dockerd.pid ]] && kill "$(cat "$run/dockerd.pid")" 2>/dev/null; then
    for _ in $(seq 60); do [[ -f $run/dockerd.pid ]] || break; sleep 0.5; done
  fi
  pids=$(pgrep -f -- "$run/" || true)
  if [[ -n $pids ]]; then
    kill -9 $pids 2>/dev/null || true
  fi
  rm -rf "$run"
}
cleanup() {
  stop_dockerd
  rm -rf "$context"
  if [[ $had_opt == 0 ]]; then
    rmdir /opt/containerd/bin /opt/containerd/lib /opt/containerd 2>/dev/null || true
  fi
}
stop_dockerd
trap cleanup EXIT
step "dockerd (data in $cache/docker)"
mkdir -p "$run"
dockerd --data-root "$cache/docker" --exec-root "$run/exec" --pidfile "$run/dockerd.pid" \
  --host "$DOCKER_HOST" --bridge=none --iptables=false --ip6tables=false --ip-masq=false \
  --storage-driver=overlay2 >"$cache/dockerd.log" 2>&1 &
for _ in $(seq 120); do
  "$docker" version >/dev/null 2>&1 && break
  sleep 0.5
done
"$docker" version >/dev/null || {
  tail -20 "$cache/dockerd.log" >&2
  echo "images.sh: dockerd did not start (its log: $cache/dockerd.log)" >&2
  exit 1
}

base_name=$(sed -n 's/^FROM \(debian:[^ ]*\) AS base-cpu$/\1/p' "$repo/Dockerfile")
# Imported once: a new import is a new image ID, which every image built on it would change with.
if ! "$docker" image inspect "$base_name" >/dev/null 2>&1; then
  step "base image $base_name from $base_tar"
  "$docker" import "$base_tar" "$base_name" >/dev/null
fi
# The sandbox (pause) image: the static pause binary alone.
if ! "$docker" image inspect berth.local/pause:e2e >/dev/null 2>&1; then
  pause_dir=$(mktemp -d)
  cp "$node_dir/pause" "$pause_dir/pause"
  tar -C "$pause_dir" -c pause |
    "$docker" import --change 'ENTRYPOINT ["/pause"]' - berth.local/pause:e2e >/dev/null
  rm -rf "$pause_dir"
fi

# The wheelhouse in the build context, hard-linked (same filesystem) or else copied.
rm -rf "$context"
cp -al "$wheelhouse" "$context" 2>/dev/null || cp -a "$wheelhouse" "$context"
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$repo/pyproject.toml")
build() {
  local target=$1 tag=$2
  shift 2
  step "docker build --target $target ($tag)"
  "$docker" build --network=host --target "$target" --tag "$tag" \
    --build-arg PYTHON=system --build-arg PACKAGES=wheelhouse --build-arg TORCH_INDEX_URL= \
    "$@" "$repo" >"$cache/build-$target.log" 2>&1 || {
    tail -40 "$cache/build-$target.log" >&2
    echo "images.sh: the $target build failed (its log: $cache/build-$target.log)" >&2
    return 1
  }
}
build router "berth.local/berth-router:$version"
build operator "berth.local/berth-operator:$version"
build runtime "berth.local/berth-runtime:$version-cpu" --build-arg VARIANT=cpu

for image in "berth.local/berth-router:$version" "berth.local/berth-operator:$version" \
  "berth.local/berth-runtime:$version-cpu" berth.local/pause:e2e; do
  name=${image#berth.local/}
  name=${name%%:*}
  id=$("$docker" image inspect --format '{{.Id}}' "$image")
  if [[ -f $out/$name.tar && $(cat "$out/$name.id" 2>/dev/null) == "$id $image" ]]; then
    continue
  fi
  step "docker save $image"
  "$docker" save "$image" -o "$out/.$name.tar"
  mv "$out/.$name.tar" "$out/$name.tar"
  echo "$id $image" >"$out/$name.id"
done
# What no image uses any more (an older build's last layers, several GB each for the runtime) is
# dropped: images without a name, and build cache this build did not use.
"$docker" image prune --force >/dev/null
"$docker" builder prune --force --filter "until=$((SECONDS - started + 60))s" >/dev/null
step "images: in $out"
