"""HTTP serving helpers of `berth serve` and `berth router`: OpenAI error handlers, SSE, uvicorn."""

from __future__ import annotations

import json
import signal
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from berth_common.errors import RequestError

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any], exclude: set[str] | None = None) -> str:
    """One server-sent event: `data: <JSON>` and a blank line (UTF-8 text left unescaped)."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def error_response(err: RequestError) -> JSONResponse:
    """A RequestError as its OpenAI error body, status and headers."""
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers or None)


def add_error_handlers(app: FastAPI, internal_error: str) -> None:
    """Answer a RequestError with its OpenAI body, and any other exception with a 500 body whose
    message is `<internal_error>: <type>: <exception>` (uvicorn logs the traceback)."""

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(RequestError(f"{internal_error}: {type(exc).__name__}: {exc}", 500))


def uvicorn_config(
    app: Any,
    *,
    host: str,
    port: int,
    log_level: str,
    graceful_shutdown_s: int,
    access_log: bool,
) -> uvicorn.Config:
    """uvicorn as Berth's servers run it: logging left to `configure_logging`'s handler, lifespan
    events on, and `graceful_shutdown_s` for requests in flight after SIGTERM."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        log_config=None,
        access_log=access_log,
        lifespan="on",
        timeout_graceful_shutdown=graceful_shutdown_s,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn whose SIGTERM or SIGINT drains and then exits 0: it stops accepting, lets the
    requests in flight finish (within `timeout_graceful_shutdown`), and returns. A second SIGINT
    exits at once.

    uvicorn itself raises the signal again once it has shut down, so the process would end killed
    by it (exit -15), which supervisors and Kubernetes report as a failure."""

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
