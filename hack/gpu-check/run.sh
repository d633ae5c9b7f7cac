#!/usr/bin/env bash
# make gpu-check: Berth's GPU tests, greedy parity with HF and the throughput table, on a machine
# with an NVIDIA GPU, its own Python 3.12 with torch, and no network. Berth runs from this
# checkout (no install); what the image lacks comes from the wheels in $WHEELS (default .whl,
# made by hack/gpu-check/wheels.sh), installed offline into a folder of their own.
# Arguments go to `python -m benchmarks.gpu_check` (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/../.."
python="${PYTHON:-python3}"
wheels="${WHEELS:-.whl}"
if compgen -G "$wheels/*.whl" >/dev/null; then
  site="${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/berth-gpu-check-site}"
  echo "[gpu-check] installing $(ls "$wheels"/*.whl | wc -l) wheels from $wheels (offline) into $site" >&2
  "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/runtime:$PWD/router:$PWD/common:$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m benchmarks.gpu_check "$@"
