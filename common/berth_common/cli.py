"""The `berth` command: `berth serve`, `router`, `operator` and `bench`, each run by the package
that owns it, and only that package imported (the router and operator images carry no engine)."""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

# command -> (the module that runs it, its line in `berth --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("berth_runtime.cli", "Serve a model on an OpenAI-compatible endpoint"),
    "operator": ("berth_operator.cli", "Run the Kubernetes operator (see `berth operator --help`)"),
    "router": ("berth_router.server", "Route requests over DP ranks (see `berth router --help`)"),
    "bench": ("berth_runtime.bench.cli", "Benchmark an OpenAI-compatible server (load generator)"),
}


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The `berth` parser and its `serve` sub-parser (which `berth_runtime.cli` fills in)."""
    parser = argparse.ArgumentParser(prog="berth", description="Berth LLM serving stack")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help=COMMANDS["serve"][1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for command in ("operator", "router", "bench"):
        sub.add_parser(command, help=COMMANDS[command][1])
    return parser, serve


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, serve_parser = build_parser()
    command = argv[0] if argv else None
    if command in ("operator", "router", "bench"):
        # These parse their own sub-commands and flags.
        return _load(command, parser).main(argv[1:])
    if command == "serve":
        # `berth serve` has no sub-commands: its flags hang off this parser, under `serve`.
        serve = _load(command, parser)
        serve.add_arguments(serve_parser)
        return serve.run(parser.parse_args(argv), parser)
    parser.parse_args(argv)  # --help, or a usage error
    return 2


def berth_command(*args: str) -> list[str]:
    """The argv of `berth <args>` run by this interpreter (for subprocesses; no PATH needed)."""
    return [sys.executable, "-m", "berth_common.cli", *args]


def _load(command: str, parser: argparse.ArgumentParser) -> ModuleType:
    module = COMMANDS[command][0]
    package = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != package:
            raise
        parser.error(f"`berth {command}` is not installed here (no {package} package)")


if __name__ == "__main__":
    sys.exit(main())
