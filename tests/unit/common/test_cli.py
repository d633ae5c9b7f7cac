"""The `berth` command: each sub-command reaches its own package, and imports no other one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from berth_common.cli import COMMANDS, berth_command, main

# Run `berth <argv>` in a fresh interpreter where the packages a command must not need cannot be
# imported at all, then list which of the watched packages it did import.
PROBE = """
import importlib.abc, sys
blocked = set(sys.argv[1].split(",")) - {""}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"blocked: {name}", name=name)
sys.meta_path.insert(0, Block())
from berth_common.cli import main
try:
    code = main(sys.argv[2:])
except SystemExit as e:
    code = e.code
watched = ("torch", "transformers", "fastapi", "kopf", "berth_runtime", "berth_router",
           "berth_operator")
print(sorted({m.partition(".")[0] for m in sys.modules} & set(watched)), code)
"""


def berth_with(blocked: list[str], *argv: str) -> tuple[str, str]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, ",".join(blocked), *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = result.stdout.strip().splitlines()
    assert lines, result.stderr
    return lines[-1], result.stderr


def test_berth_help_imports_no_deployable() -> None:
    everything = ["torch", "berth_runtime", "berth_router", "berth_operator"]
    imported, _ = berth_with(everything, "--help")
    assert imported == "[] 0"


def test_berth_router_imports_the_router_only() -> None:
    imported, _ = berth_with(["torch", "transformers", "berth_runtime", "kopf"], "router", "--help")
    assert imported == "['berth_router', 'fastapi'] 0"


def test_berth_operator_imports_the_operator_only() -> None:
    blocked = ["torch", "transformers", "fastapi", "berth_runtime", "berth_router"]
    imported, stderr = berth_with(blocked, "operator", "--help")
    assert imported.endswith(" 0"), stderr
    assert "berth_operator" in imported and "berth_runtime" not in imported


def test_a_command_whose_package_is_missing_is_a_usage_error() -> None:
    imported, stderr = berth_with(["berth_runtime"], "serve")
    assert imported.endswith(" 2")
    assert "berth: error: `berth serve` is not installed here (no berth_runtime package)" in stderr


def test_serve_flags_hang_off_the_berth_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: berth serve [-h] [--model MODEL]")
    assert "--max-running-requests" in out
    with pytest.raises(SystemExit) as e:
        main(["serve", "--max-running-requests", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: berth [-h] {serve,operator,router,bench} ...")
    assert "berth: error: --max-running-requests must be positive" in err


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert "{serve,operator,router,bench}" in out
    for command, (_, line) in COMMANDS.items():
        assert f"{command} {line}" in out


def test_berth_command_runs_this_interpreter() -> None:
    result = subprocess.run(
        berth_command("router", "--help"), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout.startswith("usage: berth router")
