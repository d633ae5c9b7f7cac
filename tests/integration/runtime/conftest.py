"""Fixtures that start real `berth serve` processes on the embedded model."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.helpers import RunningServer

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    """One fp32 server shared by the request-path tests (start-up costs seconds); it reads
    Hermes tool calls when tool_choice is auto."""
    srv = RunningServer(
        "--dtype", "float32", "--log-level", "info", "--tool-call-parser", "hermes"
    ).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


@pytest.fixture
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def aclient(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
