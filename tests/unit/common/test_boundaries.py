"""Packages by deployable: what each package may import (read from the source, not run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]

# package -> top-level modules it must never import
FORBIDDEN = {
    "common/berth_common": {"berth_runtime", "berth_router", "berth_operator", "torch"},
    "router/berth_router": {"berth_runtime", "berth_operator", "torch", "transformers"},
    "runtime/berth_runtime": {"berth_operator", "berth_router"},
}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_no_other_deployable(package: str) -> None:
    for path in sorted((REPO_ROOT / package).rglob("*.py")):
        wrong = imported_packages(path) & FORBIDDEN[package]
        assert not wrong, f"{path.relative_to(REPO_ROOT)} imports {sorted(wrong)}"


def test_the_benchmarks_ship_in_no_package() -> None:
    for package in FORBIDDEN:
        for path in (REPO_ROOT / package).rglob("*.py"):
            assert "benchmarks" not in imported_packages(path), path
