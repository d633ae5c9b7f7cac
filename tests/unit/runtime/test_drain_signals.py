"""The API process's stop signals: one drain however its own signal and its children's drain
requests interleave; only a second signal of its own stops it at once."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import uvicorn

from berth_common.process import DRAIN_REQUEST
from berth_runtime.entrypoints.http_server import ServerState
from berth_runtime.entrypoints.launch import BerthServer
from berth_runtime.server_args import ServerArgs


@pytest.fixture
def server() -> Iterator[BerthServer]:
    state = ServerState(args=ServerArgs())
    state.phase = "ready"
    state.tokenizer_manager = SimpleNamespace(draining=False, rid_to_state={})
    srv = BerthServer(uvicorn.Config(app=None), state)
    loop = asyncio.new_event_loop()
    srv._loop = loop
    yield srv
    loop.close()


def draining_once(srv: BerthServer) -> bool:
    return (
        srv.state.phase == "draining"
        and srv.state.tokenizer_manager.draining
        and not srv.should_exit
        and not srv.force_exit
    )


def test_a_signal_to_the_group_drains_once_whichever_arrives_first(server: BerthServer) -> None:
    # Python runs the handler of SIGUSR1 (a child's request) before SIGTERM's when both wait.
    server._drain_requested(DRAIN_REQUEST, None)
    server._drain_requested(DRAIN_REQUEST, None)  # the other child
    server.handle_exit(signal.SIGTERM, None)
    assert draining_once(server)


def test_own_signal_first_then_the_childrens_requests(server: BerthServer) -> None:
    server.handle_exit(signal.SIGINT, None)
    server._drain_requested(DRAIN_REQUEST, None)
    assert draining_once(server)


def test_a_second_signal_of_its_own_stops_at_once(server: BerthServer) -> None:
    server._drain_requested(DRAIN_REQUEST, None)
    server.handle_exit(signal.SIGINT, None)
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and server.force_exit


def test_a_signal_while_loading_exits_without_a_drain(server: BerthServer) -> None:
    server.state.phase = "loading"
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit and not server.force_exit
    assert server.state.phase == "loading"
