#!/usr/bin/env bash
# Build llama.cpp's `llama-server`, the baseline `make bench` compares Berth with, from source.
#
# The sources are the llama.cpp tree vendored in llama-cpp-python's sdist on PyPI (a registry
# most build machines can reach, where GitHub's release pages may not be), at the version pinned
# below. Only the server is built, for the CPU it is built on (-march=native: AVX2 / AVX-512 as
# available), without CURL or tests. LLAMA_ISA=avx2 builds for AVX2 CPUs instead (AVX2, FMA and
# F16C, no AVX-512): what llama.cpp runs on an AVX2-only machine, for `make bench-avx2` on any
# CPU. Set LLAMA_CMAKE_ARGS to add CMake options (on a VM whose kernel refuses AMX tiles:
# "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"). The result is cached by version
# (and ISA), built next to its final place and renamed into it whole:
#
#   ${XDG_CACHE_HOME:-$HOME/.cache}/berth/llama-server/<version>[-avx2]/llama-server
#
# `make bench` (benchmarks/systems.py) finds it there, or any `llama-server` on PATH.
#
# usage: hack/llama-server/build.sh              build, or reuse the cache
#        hack/llama-server/build.sh --print-path print the binary's path (built or not)
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PYTHON=${PYTHON:-python3}
cache_root=${XDG_CACHE_HOME:-$HOME/.cache}/berth/llama-server
LLAMA_ISA=${LLAMA_ISA:-native}
case $LLAMA_ISA in
  native) dest=$cache_root/$LLAMA_CPP_PYTHON_VERSION; isa_args=(-DGGML_NATIVE=ON) ;;
  avx2)
    dest=$cache_root/$LLAMA_CPP_PYTHON_VERSION-avx2
    isa_args=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
      -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    ;;
  *) echo "error: LLAMA_ISA=$LLAMA_ISA: native or avx2" >&2; exit 1 ;;
esac

if [[ ${1-} == --print-path ]]; then
  echo "$dest/llama-server"
  exit 0
fi
if [[ -x $dest/llama-server ]]; then
  echo "==> llama-server (llama-cpp-python $LLAMA_CPP_PYTHON_VERSION, $LLAMA_ISA): cached at $dest"
  exit 0
fi
for tool in cmake c++ "$PYTHON"; do
  command -v "$tool" >/dev/null || { echo "error: $tool is needed to build llama-server" >&2; exit 1; }
done

mkdir -p "$cache_root"
work=$(mktemp -d "$cache_root/.build-XXXXXX")
trap 'rm -rf "$work"' EXIT
start=$SECONDS

echo "==> downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist from PyPI"
"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
  "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$work"
tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)

echo "==> building llama-server (the long step: several minutes on 2 cores)"
# shellcheck disable=SC2086 # LLAMA_CMAKE_ARGS is a list of options
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release "${isa_args[@]}" \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
  ${LLAMA_CMAKE_ARGS-} >"$work/cmake.log" 2>&1 || { tail -20 "$work/cmake.log" >&2; exit 1; }
cmake --build "$work/build" --target llama-server -j "$(nproc)" >"$work/build.log" 2>&1 \
  || { grep -m5 -i error "$work/build.log" >&2 || tail -20 "$work/build.log" >&2; exit 1; }

mkdir -p "$work/out"
cp "$work/build/bin/llama-server" "$work/out/"
rm -rf "$dest"
mv "$work/out" "$dest"
echo "==> llama-server built in $((SECONDS - start)) s: $dest/llama-server"
