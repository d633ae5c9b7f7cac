"""`berth serve`'s command line: its flags (`ServerArgs`) on the `berth` parser, then the launch."""

from __future__ import annotations

import argparse

from berth_runtime.server_args import ServerArgs

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every `berth serve` flag, one per `ServerArgs` field."""
    ServerArgs.add_cli_args(parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Serve until shut down; a flag value `ServerArgs` refuses is a usage error of `parser`."""
    try:
        server_args = ServerArgs.from_cli_args(args)
    except ValueError as e:
        parser.error(str(e))
    from berth_runtime.utils.torch_free import forbid_torch

    forbid_torch()  # this is the API process: only the scheduler runs the model
    from berth_runtime.entrypoints.launch import launch_server

    return launch_server(server_args)
