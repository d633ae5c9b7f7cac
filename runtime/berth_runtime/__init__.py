"""Berth serving runtime: OpenAI-compatible server, scheduler, engine and router."""

__version__ = "0.1.0"
