"""Test-suite options and markers shared by every test folder."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

# Before anything imports torch: a $BERTH_CPU_ISA cap (BERTH_CPU_ISA=avx2 runs the AVX2 paths on
# an AVX-512 machine) must reach PyTorch, oneDNN and MKL as they start.
import berth_runtime  # noqa: F401


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-e2e",
        action="store_true",
        default=False,
        help="run the tests marked e2e (they need a real cluster, e.g. kind, and kubectl)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-e2e"):
        return
    skip = pytest.mark.skip(reason="needs a cluster: run with --run-e2e")
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(skip)


# CPython 3.11 before 3.11.8 (gh-106905; this machine's Python is 3.11.7) keeps ast.parse's
# recursion count in interpreter-wide state: when a garbage collection inside ast.parse lets
# another thread run an ast.parse of its own (3.11's tracebacks parse each line for their ^^^
# markers), the first one fails with "SystemError: AST constructor recursion depth mismatch".
# pytest parses whole source files to render a failure, so a failure deep in torch's code, say,
# could end the whole run in an INTERNALERROR. No collection runs while a report is rendered.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport() -> Iterator[None]:
    with _no_gc():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report() -> Iterator[None]:
    with _no_gc():
        return (yield)


class _no_gc:
    def __enter__(self) -> None:
        self.was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was_enabled:
            gc.enable()
