"""The memory of a server's process tree: RSS (and PSS) summed over it, and sampled while a
benchmark runs."""

from __future__ import annotations

import threading
from typing import Any


def tree_memory(pid: int, with_pss: bool = False) -> dict[str, Any] | None:
    """RSS (and PSS) summed over `pid` and all its descendants; None if it is gone.

    RSS counts shared pages (libraries, torch) once per process, so the sum overstates what the
    tree really holds; PSS splits shared pages between the processes that map them."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    rss = 0
    pss: int | None = 0 if with_pss else None
    by_process = []
    for proc in procs:
        try:
            if with_pss:
                info = proc.memory_full_info()
                proc_pss = getattr(info, "pss", info.uss)
                pss = (pss or 0) + proc_pss
                title = " ".join(proc.cmdline()).strip()[:60] or proc.name()
                by_process.append(
                    {"pid": proc.pid, "title": title, "rss": info.rss, "pss": proc_pss}
                )
            else:
                info = proc.memory_info()
            rss += info.rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    if not by_process and not rss:
        return None
    count = len(by_process) if with_pss else len(procs)
    out: dict[str, Any] = {"processes": count, "rss_bytes": rss, "pss_bytes": pss}
    if with_pss:
        out["by_process"] = by_process
    return out


class MemorySampler:
    """Samples a process tree's summed RSS in a thread; keeps the peak."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.pid = pid
        self.interval = interval
        self.peak_rss = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> dict[str, Any] | None:
        mem = tree_memory(self.pid)
        if mem is not None:
            self.peak_rss = max(self.peak_rss, mem["rss_bytes"])
            self.samples += 1
        return mem

    def start(self) -> MemorySampler:
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any] | None:
        """Stop sampling; the final reading with PSS plus the peak RSS, in MiB."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        final = tree_memory(self.pid, with_pss=True)
        if final is None and not self.samples:
            return None
        mib = 1024 * 1024
        peak = max(self.peak_rss, final["rss_bytes"] if final else 0)
        return {
            "pid": self.pid,
            "processes": final["processes"] if final else None,
            "peak_rss_mib": peak / mib,
            "rss_mib": final["rss_bytes"] / mib if final else None,
            "pss_mib": final["pss_bytes"] / mib if final and final["pss_bytes"] else None,
            "by_process": [
                {"pid": p["pid"], "title": p["title"], "rss_mib": p["rss"] / mib}
                for p in (final or {}).get("by_process", [])
            ],
        }
