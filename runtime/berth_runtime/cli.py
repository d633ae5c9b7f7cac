"""The `berth` command: `berth serve`, `berth router`, `berth operator ...`, `berth bench`."""

from __future__ import annotations

import argparse
import sys

from berth_runtime.server_args import ServerArgs


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "operator":
        # The operator lives in its own import package and needs no torch.
        from berth_operator.cli import main as operator_main

        return operator_main(argv[1:])
    if argv and argv[0] == "bench":
        from berth_runtime.bench.cli import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "router":
        from berth_runtime.router.server import main as router_main

        return router_main(argv[1:])

    parser = argparse.ArgumentParser(prog="berth", description="Berth LLM serving stack")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="Serve a model on an OpenAI-compatible endpoint",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ServerArgs.add_cli_args(serve)
    sub.add_parser("operator", help="Run the Kubernetes operator (see `berth operator --help`)")
    sub.add_parser("router", help="Route requests over DP ranks (see `berth router --help`)")
    sub.add_parser("bench", help="Benchmark a server, or compare Berth with HF transformers")
    args = parser.parse_args(argv)

    if args.command == "serve":
        try:
            server_args = ServerArgs.from_cli_args(args)
        except ValueError as e:
            parser.error(str(e))
        from berth_runtime.entrypoints.launch import launch_server

        return launch_server(server_args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
