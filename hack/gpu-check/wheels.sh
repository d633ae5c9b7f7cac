#!/usr/bin/env bash
# Download, on a machine with network access, the wheels `make gpu-check` installs offline on a
# GPU machine (Python 3.12, x86-64 Linux): hack/gpu-check/wheels.txt, pinned, without their
# dependencies (the list is whole). Usage: hack/gpu-check/wheels.sh [DIR]   (default: .whl)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dest="${1:-.whl}"
python="${PYTHON:-python3}"
platforms=()
for n in 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do platforms+=(--platform "manylinux_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
"$python" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$dest" -r "$here/wheels.txt"
echo "wheels for make gpu-check in $dest:" && ls "$dest"
