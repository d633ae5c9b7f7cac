"""Berth common: what several deployables share (errors, auth, CLI dataclasses, logging, processes,
HTTP helpers) and the `berth` command that dispatches to each of them."""

__version__ = "0.1.0"
