"""Berth serving runtime: the OpenAI-compatible API server and the engine behind it."""

from berth_common import __version__

__all__ = ["__version__"]
