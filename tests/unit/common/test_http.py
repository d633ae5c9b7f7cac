"""The HTTP helpers both servers use: OpenAI error bodies and server-sent events."""

from __future__ import annotations

import httpx
from fastapi import FastAPI
from pydantic import BaseModel

from berth_common.errors import RequestError
from berth_common.http import SSE_DONE, add_error_handlers, sse_event


class Chunk(BaseModel):
    text: str
    usage: int | None = None


def test_sse_event_from_a_model_or_a_dict_keeps_utf8() -> None:
    assert sse_event(Chunk(text="é")) == 'data: {"text":"é","usage":null}\n\n'
    assert sse_event(Chunk(text="a"), exclude={"usage"}) == 'data: {"text":"a"}\n\n'
    assert sse_event({"error": {"message": "ß"}}) == 'data: {"error": {"message": "ß"}}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"


async def test_errors_become_openai_bodies() -> None:
    app = FastAPI()
    add_error_handlers(app, "test error")

    @app.get("/refused")
    async def refused() -> None:
        raise RequestError("full", 503, headers={"Retry-After": "1"})

    @app.get("/broken")
    async def broken() -> None:
        raise KeyError("x")

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        refused_response = await client.get("/refused")
        broken_response = await client.get("/broken")
    assert refused_response.status_code == 503
    assert refused_response.headers["retry-after"] == "1"
    assert refused_response.json() == {
        "error": {
            "message": "full",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
    }
    # A crash says nothing of its cause to the client; the log has the traceback under the id.
    assert broken_response.status_code == 500
    error = broken_response.json()["error"]
    assert error["type"] == "InternalServerError" and error["code"] == "internal_error"
    assert error["message"].startswith("test error (error id ")
    assert "KeyError" not in broken_response.text


def test_a_named_event_says_its_name_first() -> None:
    assert sse_event({"type": "x"}, event="x") == 'event: x\ndata: {"type": "x"}\n\n'


async def test_a_405_allows_every_method_of_the_path_not_only_the_first_routes() -> None:
    app = FastAPI()
    add_error_handlers(app, "test error")

    @app.get("/items/{item}")
    async def read(item: str) -> None: ...

    @app.delete("/items/{item}")
    async def forget(item: str) -> None: ...

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.post("/items/7")
    assert response.status_code == 405
    assert response.headers["allow"] == "DELETE, GET"
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_an_idle_connection_outlives_the_clients_keep_alive() -> None:
    """A client that reuses a connection after 6 s idle (the operator scrapes every 5 s; httpx
    keeps connections 5 s) finds it open: the server must not close it first."""
    import socket
    import threading
    import time

    import uvicorn

    from berth_common.http import KEEP_ALIVE_S, uvicorn_config
    from berth_common.server_process import free_port

    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, bool]:
        return {"ok": True}

    port = free_port()
    config = uvicorn_config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        graceful_shutdown_s=1,
        access_log=False,
    )
    assert config.timeout_keep_alive == KEEP_ALIVE_S > 60
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        request = f"GET /ping HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            for attempt in range(2):
                if attempt:
                    time.sleep(6)  # past uvicorn's own default (5 s)
                conn.sendall(request)
                reply = conn.recv(4096)
                assert reply.startswith(b"HTTP/1.1 200"), (attempt, reply)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
