"""A late heartbeat with a step reported running is work; silence on both, or a step past the
watchdog, is a stuck engine."""

from __future__ import annotations

import threading
import time

import msgspec
import zmq

from berth_runtime.io_struct import SchedulerBusy, ToTokenizer
from berth_runtime.managers.engine_liveness import (
    BUSY_REPORT_INTERVAL_S,
    EngineLiveness,
    StepClock,
    report_long_steps,
)

STALE, LIMIT = 5.0, 60.0


def test_fresh_heartbeats_are_healthy() -> None:
    live = EngineLiveness(last_heartbeat=100.0)
    assert live.problem(104.0, STALE, LIMIT) is None
    problem = live.problem(106.0, STALE, LIMIT)
    assert problem is not None and "no scheduler heartbeat for 6.0s" in problem


def test_a_long_step_that_reports_itself_is_healthy_until_the_watchdog() -> None:
    live = EngineLiveness(last_heartbeat=100.0)
    live.busy(107.0, step_s=7.2)  # the step began about when the heartbeats stopped
    assert live.problem(108.0, STALE, LIMIT) is None
    live.busy(159.0, step_s=59.2)
    assert live.problem(159.5, STALE, LIMIT) is None
    problem = live.problem(161.0, STALE, LIMIT)
    assert problem is not None and "one engine step has run for 61s" in problem


def test_busy_reports_that_stop_mean_stuck_and_a_heartbeat_clears_them() -> None:
    live = EngineLiveness(last_heartbeat=100.0)
    live.busy(103.0, step_s=2.5)
    # The reporter went quiet too (the scheduler holds the GIL in a wedged call).
    problem = live.problem(109.0, STALE, LIMIT)
    assert problem is not None and "no scheduler heartbeat" in problem
    live.heartbeat(110.0)
    assert live.last_busy is None and live.problem(112.0, STALE, LIMIT) is None


def test_the_reporter_sends_only_while_a_step_runs_long() -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    decoder = msgspec.msgpack.Decoder(ToTokenizer)
    clock = StepClock()
    report_long_steps(clock, ctx, f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(3 * BUSY_REPORT_INTERVAL_S)  # between steps: nothing
        assert pull.poll(0) == 0
        clock.start()
        done = threading.Event()
        threading.Timer(6 * BUSY_REPORT_INTERVAL_S, done.set).start()
        reports = []
        while not done.is_set():
            if pull.poll(100):
                reports.append(decoder.decode(pull.recv()))
        clock.stop()
        assert reports and all(isinstance(r, SchedulerBusy) for r in reports)
        steps = [r.step_s for r in reports]
        assert steps == sorted(steps) and steps[0] >= BUSY_REPORT_INTERVAL_S
        time.sleep(2 * BUSY_REPORT_INTERVAL_S)
        while pull.poll(0):  # at most one report was already on its way
            pull.recv()
        time.sleep(2 * BUSY_REPORT_INTERVAL_S)
        assert pull.poll(0) == 0
    finally:
        pull.close(linger=0)
        ctx.destroy(linger=0)
