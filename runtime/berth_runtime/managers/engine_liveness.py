"""Is the engine working? The heartbeat, and the long step that can hold it up, judged together.

The scheduler's heartbeat (`SchedulerStats`, through the detokenizer) is sent between steps. One
long step (an 8k-token prefill on two busy cores) holds it up for seconds, and a heartbeat alone
would call a working server stuck: `/health` would turn 503 and Kubernetes restart the pod in the
middle of its requests. So, while a step runs longer than a heartbeat interval, a thread of the
scheduler reports it straight to the API process (`SchedulerBusy`, every interval). A late
heartbeat with a fresh busy report is a step at work; the engine is stuck only when both are
silent, or when one step outlasts `--watchdog-timeout`.

The thread cannot run while the scheduler holds the GIL in a wedged C call, and a step stuck in a
Python loop keeps growing its age: both still end as stuck.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import zmq

from berth_runtime.io_struct import SchedulerBusy
from berth_runtime.utils.zmq_ipc import Sender

BUSY_REPORT_INTERVAL_S = 0.5


@dataclass
class EngineLiveness:
    """What the API process has heard from the engine loop, and what it concludes."""

    last_heartbeat: float
    last_busy: float | None = None  # when the last SchedulerBusy came
    busy_step_s: float = 0.0  # how long the step had run then

    def heartbeat(self, now: float) -> None:
        self.last_heartbeat = now
        self.last_busy = None

    def busy(self, now: float, step_s: float) -> None:
        self.last_busy = now
        self.busy_step_s = step_s

    def problem(self, now: float, stale_after_s: float, step_limit_s: float) -> str | None:
        """Why the engine counts as stuck now; None while it shows signs of work."""
        silent = now - self.last_heartbeat
        if silent <= stale_after_s:
            return None
        if self.last_busy is not None and now - self.last_busy <= stale_after_s:
            step_s = self.busy_step_s + (now - self.last_busy)
            if step_s <= step_limit_s:
                return None
            return f"one engine step has run for {step_s:.0f}s (over the watchdog's limit)"
        return f"no scheduler heartbeat for {silent:.1f}s: the engine loop is stuck"


class StepClock:
    """The scheduler's current step: when it started (None between steps)."""

    def __init__(self) -> None:
        self.started: float | None = None

    def start(self) -> None:
        self.started = time.monotonic()

    def stop(self) -> None:
        self.started = None


def report_long_steps(clock: StepClock, ctx: zmq.Context, address: str) -> threading.Thread:
    """Start the scheduler's thread that sends SchedulerBusy to `address` (the API process) while
    a step has run longer than BUSY_REPORT_INTERVAL_S."""

    def run() -> None:
        try:
            sender = Sender(ctx, address)  # its own socket: ZeroMQ sockets stay in their thread
            while True:
                time.sleep(BUSY_REPORT_INTERVAL_S)
                started = clock.started
                if started is not None:
                    step_s = time.monotonic() - started
                    if step_s >= BUSY_REPORT_INTERVAL_S:
                        sender.send(SchedulerBusy(step_s=step_s))
        except zmq.ZMQError:
            return  # the context was closed: the process is going away

    thread = threading.Thread(target=run, name="berth-step-reporter", daemon=True)
    thread.start()
    return thread
