"""Download every wheel the Dockerfile's images install into a wheelhouse on the host, for
builds with `--build-arg PACKAGES=wheelhouse` (no package index inside the build).

The requirements are the Dockerfile's own pins (every `pip install` line of every stage, torch
taken from PyPI), the project's build backend (pyproject.toml's [build-system] requires) and uv,
with their dependencies as pip resolves them for this host's Python (the e2e images run Debian
bookworm's 3.11, the same ABI). The wheelhouse is cached, keyed by that list:

    ${XDG_CACHE_HOME:-~/.cache}/berth/wheelhouse/<sha256 of the list, 16 hex>/

written next to its final place and renamed into it when complete. Prints the directory.

usage: python hack/e2e/wheelhouse.py [--print-dir]
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+!-]*)")


def requirements() -> list[str]:
    """The Dockerfile's pins and the build backend, sorted, without duplicates; those it
    installs with --no-deps are marked so (`--no-deps NAME==VERSION`)."""
    dockerfile = (REPO_ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    found = set()
    for line in dockerfile.splitlines():
        for command in line.split("&&"):
            if "pip install" in command and not line.lstrip().startswith("#"):
                prefix = "--no-deps " if "--no-deps" in command else ""
                found.update(f"{prefix}{n}=={v}" for n, v in PIN.findall(command))
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    found.update(project["build-system"]["requires"])
    return sorted(found)


def cache_dir(reqs: list[str]) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    key = hashlib.sha256("\n".join(reqs).encode()).hexdigest()[:16]
    return root / "berth" / "wheelhouse" / key


def main(argv: list[str]) -> int:
    reqs = requirements()
    dest = cache_dir(reqs)
    if argv == ["--print-dir"]:
        print(dest)
        return 0
    if argv:
        print(__doc__.rsplit("usage: ", 1)[1], file=sys.stderr, end="")
        return 2
    if (dest / "requirements.txt").is_file():
        print(dest)
        return 0
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download.") as work:
        # Wheels only: nothing is compiled inside the image build.
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:"]
        with_deps = [r for r in reqs if not r.startswith("--no-deps ")]
        without_deps = [r.removeprefix("--no-deps ") for r in reqs if r not in with_deps]
        for args in (with_deps, ["--no-deps", *without_deps]):
            result = subprocess.run([*command, "--dest", work, *args])
            if result.returncode != 0:
                print(f"wheelhouse.py: pip download failed ({result.returncode})", file=sys.stderr)
                return 1
        # Written last: its presence marks a complete wheelhouse.
        Path(work, "requirements.txt").write_text("\n".join(reqs) + "\n")
        os.chmod(work, 0o755)  # mkdtemp made it private; the image build reads it
        os.replace(work, dest)
        os.mkdir(work)  # for TemporaryDirectory's cleanup
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
