"""Test-suite options and markers shared by every test folder."""

from __future__ import annotations

import pytest


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
