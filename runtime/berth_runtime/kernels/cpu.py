"""Build (once, cached) and load Berth's C++ CPU kernels (`kernels/*.cpp`) as torch.ops.berth.*.

The library is compiled for the SIMD level PyTorch itself dispatches to on the running CPU
(AVX-512, AVX2 or plain C++), by calling the C++ compiler directly against PyTorch's headers: no
Python headers or ninja needed, about ten seconds once. It is cached under a name keyed by the
source, the flags and the PyTorch version, written atomically (concurrent servers may build at
the same time: the last rename wins, both files are whole). Images prebuild every level into
`$BERTH_KERNELS_DIR` (`python -m berth_runtime.kernels.cpu --all DIR`), so pods need no compiler.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

# One library from these sources: attention, norms and logits; quantized projections on integer dot
# products (the ops, then one file per instruction set); a decode step's layers in one call.
SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "cpu_kernels.cpp",
        "quant_linear.cpp",
        "quant_linear_avx512.cpp",
        "quant_linear_avx2.cpp",
        "decode_layers.cpp",
    )
)
# Included by the sources: part of the cache key.
HEADERS = (Path(__file__).with_name("quant_linear.h"),)
KERNELS_DIR_ENV = "BERTH_KERNELS_DIR"
# Head dims the attention kernels are instantiated for.
ATTENTION_HEAD_DIMS = (64, 128, 256)
# The storage dtypes the kernels take (by name: torch is imported lazily here).
DTYPES_BY_NAME = ("float32", "bfloat16")

# Compiler flags per PyTorch CPU capability: the ISA level PyTorch's own kernels use there.
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "DEFAULT": [],
}


class KernelBuildError(RuntimeError):
    """The kernels could not be compiled or loaded here (no compiler, a failed build, ...)."""


_lock = threading.Lock()
_loaded: Path | None = None
_error: str | None = None


# torch is imported where it is used: the API process checks the toolchain without loading it.


def cpu_capability() -> str:
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in ISA_FLAGS else "DEFAULT"


def compile_command(capability: str, output: Path) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    includes = [arg for path in cpp_extension.include_paths() for arg in ("-isystem", path)]
    libs = [f"-L{path}" for path in cpp_extension.library_paths()]
    return [
        os.environ.get("CXX", "c++"),
        "-O3",
        "-std=c++20",
        "-fPIC",
        "-shared",
        "-fopenmp",  # at::vec and the parallel loops; links the libgomp PyTorch already loaded
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-DCPU_CAPABILITY={capability}",
        f"-DCPU_CAPABILITY_{capability}",
        *ISA_FLAGS[capability],
        *includes,
        *(str(source) for source in SOURCES),
        *libs,
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{':'.join(cpp_extension.library_paths())}",
        "-o",
        str(output),
    ]


def library_name(capability: str) -> str:
    """File name of the built library: changes with the source, the flags and PyTorch."""
    import torch

    flags = " ".join(ISA_FLAGS[capability])
    key = hashlib.sha256(
        b"".join(source.read_bytes() for source in SOURCES + HEADERS)
        + flags.encode()
        + torch.__version__.encode()
    ).hexdigest()[:16]
    return f"berth_cpu_kernels-{capability.lower()}-{key}.so"


def toolchain_problem() -> str | None:
    """Why no library could be built here when none is prebuilt, or None (cheap: no torch)."""
    prebuilt = os.environ.get(KERNELS_DIR_ENV)
    if prebuilt and any(Path(prebuilt).glob("berth_cpu_kernels-*.so")):
        return None
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH and no prebuilt kernels in ${KERNELS_DIR_ENV}"
    return None


def build(directory: Path, capability: str) -> Path:
    """Compile the library for `capability` into `directory`; returns its path."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C++ compiler ({compiler}) on PATH")
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / library_name(capability)
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=".build-", suffix=".so")
    os.close(fd)
    tmp = Path(tmp_name)
    command = compile_command(capability, tmp)
    start = time.perf_counter()
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            errors = [line for line in result.stderr.splitlines() if "error" in line]
            detail = (errors or result.stderr.strip().splitlines() or ["no output"])[0]
            logger.debug("kernel build failed: %s\n%s", shlex.join(command), result.stderr)
            raise KernelBuildError(f"building the CPU kernels failed: {detail}")
        # mkstemp made it 0600: readable by every user, as a compiler's output would be (an
        # image builds its kernels as root and runs as another user).
        tmp.chmod(0o644)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    elapsed = time.perf_counter() - start
    logger.info("Built the CPU kernels (%s) in %.1fs: %s", capability, elapsed, target)
    return target


def load(cache_dir: Path) -> Path:
    """Load the kernels for this CPU: prebuilt in $BERTH_KERNELS_DIR, cached in
    `cache_dir`/kernels, or built there now. Raises KernelBuildError with the reason."""
    import torch

    global _loaded, _error
    with _lock:
        if _loaded is not None:
            return _loaded
        if _error is not None:
            raise KernelBuildError(_error)
        capability = cpu_capability()
        name = library_name(capability)
        candidates = [Path(d) / name for d in [os.environ.get(KERNELS_DIR_ENV)] if d]
        candidates.append(cache_dir / "kernels" / name)
        try:
            path = next((p for p in candidates if p.is_file()), None)
            if path is None:
                path = build(cache_dir / "kernels", capability)
            torch.ops.load_library(str(path))
        except KernelBuildError as e:
            _error = str(e)
            raise
        except OSError as e:
            _error = f"loading the CPU kernels failed: {e}"
            raise KernelBuildError(_error) from e
        _loaded = path
        logger.info("Loaded Berth's CPU kernels (%s) from %s", capability, path)
        return path


def loaded_library() -> Path | None:
    """The kernels' library this process loaded, or None (not loaded, or loading failed)."""
    return _loaded


def quant_linear_available() -> bool:
    """Whether `torch.ops.berth.quant_linear` runs here: the kernels are loaded and the CPU has
    AVX2 or AVX-512BW (the kernel picks the best, VNNI included: `quant_linear_isa`)."""
    import torch

    return _loaded is not None and bool(torch.ops.berth.quant_linear_supported())


def quant_linear_isa() -> str | None:
    """The instruction set `quant_linear` runs on here (`avx2`, `avx512bw`, `avx512_vnni`), or
    None where it does not run."""
    import torch

    return str(torch.ops.berth.quant_linear_isa()) if quant_linear_available() else None


def attention_supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the attention kernels are built for this attention shape."""
    return head_dim in ATTENTION_HEAD_DIMS and num_kv_heads > 0 and num_heads % num_kv_heads == 0


def main(argv: list[str] | None = None) -> int:
    """Prebuild the kernels into a directory (for images: point $BERTH_KERNELS_DIR at it)."""
    parser = argparse.ArgumentParser(prog="python -m berth_runtime.kernels.cpu")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--all", action="store_true", help="every SIMD level, not just this CPU's")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for capability in ISA_FLAGS if args.all else [cpu_capability()]:
        try:
            build(args.directory, capability)
        except KernelBuildError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
