#!/usr/bin/env bash
# The Debian base of the e2e images, made with debootstrap (no registry is reachable here) and
# cached as a root filesystem tarball, which hack/e2e/images.sh imports under the name the
# Dockerfile's FROM lines use. Debian bookworm, --variant=minbase (what the slim images hold:
# apt, dpkg and the essential packages), from the same apt mirror as the host.
#
#   ${XDG_CACHE_HOME:-$HOME/.cache}/berth/e2e/debian-bookworm-minbase.tar
#
# usage: hack/e2e/base-image.sh   print the tarball's path, made first if missing
set -euo pipefail

cache=${XDG_CACHE_HOME:-$HOME/.cache}/berth/e2e
tarball=$cache/debian-bookworm-minbase.tar
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if [[ -f $tarball ]]; then
  echo "$tarball"
  exit 0
fi
command -v debootstrap >/dev/null || {
  echo "base-image.sh: debootstrap is missing (apt-get install debootstrap; hack/e2e/host.sh does)" >&2
  exit 1
}
mkdir -p "$cache"
work=$(mktemp -d "$cache/.debootstrap.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "==> debootstrap --variant=minbase bookworm ($mirror), about 2.5 minutes" >&2
if ! debootstrap --variant=minbase bookworm "$work/root" "$mirror" >"$work/debootstrap.log" 2>&1; then
  tail -30 "$work/debootstrap.log" >&2
  echo "base-image.sh: debootstrap failed" >&2
  exit 1
fi
# As the official slim images do: no apt lists or caches in the layer.
rm -rf "$work/root/var/lib/apt/lists/"* "$work/root/var/cache/apt/"*.bin "$work/root/var/log/"*
tar --numeric-owner -C "$work/root" -cf "$work/base.tar" .
mv "$work/base.tar" "$tarball"
echo "$tarball"
