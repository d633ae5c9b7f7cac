"""Process plumbing: titles, dying with the parent, and stopping children."""

from __future__ import annotations

import contextlib
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


# Between a server's main process and its children (the scheduler and the detokenizer):
# a child that is sent SIGTERM or SIGINT asks its parent to drain with DRAIN_REQUEST, and exits
# only when its parent sends STOP_CHILD, once the requests in flight are done.
DRAIN_REQUEST = signal.SIGUSR1
STOP_CHILD = signal.SIGUSR2


def init_child_process(name: str) -> int:
    """Common start of every child: title, parent-death signal, and the terminal signals handed
    to the parent.

    SIGTERM and SIGINT reach children from `kill -TERM -- -PGID`, `docker stop` behind an init,
    systemd, `timeout` or a Ctrl-C in the terminal. Exiting on them would fail every request in
    flight; instead the child asks its parent to drain (which is idempotent, so a signal to the
    whole group drains once) and keeps serving until the parent stops it. Returns the parent's
    pid, for loops that also poll it.
    """
    set_process_title(name)
    die_with_parent()
    parent = os.getppid()

    def ask_parent_to_drain(signum: int, _frame: object) -> None:
        received = signal.Signals(signum).name
        logger.info("%s: received %s; asking the server to drain", name, received)
        with contextlib.suppress(ProcessLookupError):
            os.kill(parent, DRAIN_REQUEST)

    signal.signal(signal.SIGTERM, ask_parent_to_drain)
    signal.signal(signal.SIGINT, ask_parent_to_drain)
    signal.signal(STOP_CHILD, lambda *_: os._exit(0))
    return parent


def stop_processes(procs: list[mp.process.BaseProcess], timeout: float = 5.0) -> None:
    """Send each child STOP_CHILD, wait, then SIGKILL whatever is left."""
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, STOP_CHILD)
    for proc in procs:
        proc.join(timeout)
        if proc.is_alive():
            logger.warning("%s did not stop; killing it", proc.name)
            proc.kill()
            proc.join(1.0)
