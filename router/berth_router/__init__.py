"""Berth router: spreads OpenAI-compatible requests over data-parallel ranks (no torch)."""

from berth_common import __version__

__all__ = ["__version__"]
