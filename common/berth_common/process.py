"""Process plumbing: titles, dying with the parent, and stopping children."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def set_process_title(name: str) -> None:
    """Show `berth::<name>` in ps/top."""
    try:
        import setproctitle

        setproctitle.setproctitle(f"berth::{name}")
    except ImportError:  # optional: titles are cosmetic
        pass


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux), so no orphans remain."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def init_child_process(name: str) -> int:
    """Common start of every child: title, parent-death signal, Ctrl-C left to the parent.

    Returns the parent's pid, for loops that also poll it.
    """
    set_process_title(name)
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    return os.getppid()


def stop_processes(procs: list[mp.process.BaseProcess], timeout: float = 5.0) -> None:
    """SIGTERM, wait, then SIGKILL whatever is left."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout)
        if proc.is_alive():
            logger.warning("%s did not stop; killing it", proc.name)
            proc.kill()
            proc.join(1.0)
