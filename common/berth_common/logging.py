"""configure_logging: one log format for every process, naming the process on each line."""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s [%(process_name)s] %(name)s: %(message)s"


class _ProcessNameFilter(logging.Filter):
    def __init__(self, process_name: str) -> None:
        super().__init__()
        self.process_name = process_name

    def filter(self, record: logging.LogRecord) -> bool:
        record.process_name = self.process_name
        return True


def configure_logging(level: str, process_name: str) -> None:
    """Send this process's logs to stderr in the shared format; safe to call more than once."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
    handler.addFilter(_ProcessNameFilter(process_name))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Libraries that are chatty at INFO.
    for noisy in ("httpx", "httpcore", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
