"""HTTP serving helpers of `berth serve` and `berth router`: OpenAI error handlers, SSE, uvicorn."""

from __future__ import annotations

import json
import logging
import signal
import uuid
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from berth_common.errors import RequestError

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"


def sse_event(
    payload: BaseModel | dict[str, Any], exclude: set[str] | None = None, event: str | None = None
) -> str:
    """One server-sent event: `data: <JSON>` (after `event: <name>` when named, as the Responses
    API's events are) and a blank line (UTF-8 text left unescaped)."""
    name = f"event: {event}\n" if event else ""
    if isinstance(payload, BaseModel):
        return f"{name}data: {payload.model_dump_json(exclude=exclude)}\n\n"
    return f"{name}data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def error_response(err: RequestError) -> JSONResponse:
    """A RequestError as its OpenAI error body, status and headers."""
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers or None)


def allowed_methods(app: FastAPI, scope: dict[str, Any]) -> list[str]:
    """Every method some route serves on this path. Starlette's 405 names only the first route
    that matches the path, and one path may have a route per method (GET and DELETE)."""
    methods: set[str] = set()
    for route in app.router.routes:
        if isinstance(route, Route) and route.path_regex.match(scope["path"]):
            methods |= route.methods or set()
    return sorted(methods)


def add_error_handlers(app: FastAPI, internal_error: str) -> None:
    """Every error as an OpenAI body: a RequestError as itself, an unknown route (404) or method
    (405) as such, and any other exception as a 500 that says `<internal_error>` and an error id;
    the traceback goes to the log under that id, never to the client."""

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 404:
            message, code = "no such route", "not_found"
        elif exc.status_code == 405:
            message, code = "method not allowed on this route", "method_not_allowed"
            headers["Allow"] = ", ".join(allowed_methods(app, request.scope))
        else:
            message, code = str(exc.detail), None
        return error_response(RequestError(message, exc.status_code, code=code, headers=headers))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        error_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        logger.error(
            "%s %s failed (error id %s)",
            request.method,
            request.url.path,
            error_id,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        return error_response(
            RequestError(f"{internal_error} (error id {error_id})", 500, code="internal_error")
        )


# How long an idle keep-alive connection stays open: longer than any client in front of the
# servers keeps one (the router's pool 30 s, httpx's default 5 s, load balancers' usual 60 s).
# uvicorn's own 5 s is as long as the operator's scrape interval, so on real pods every few
# scrapes reused a connection at the moment the rank closed it ("Server disconnected without
# sending a response"), the rank read as Unreachable and autoscaling never saw a quiet window.
KEEP_ALIVE_S = 75


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
    events on, `graceful_shutdown_s` for requests in flight after SIGTERM, and idle connections
    kept open for KEEP_ALIVE_S."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        log_config=None,
        access_log=access_log,
        lifespan="on",
        timeout_graceful_shutdown=graceful_shutdown_s,
        timeout_keep_alive=KEEP_ALIVE_S,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn whose SIGTERM or SIGINT drains and then exits 0: it stops accepting, lets the
    requests in flight finish (within `timeout_graceful_shutdown`), and returns. A second signal
    that is one of `force_exit_signals` exits at once. Subclasses change how the drain starts
    (`begin_drain`), not how signals are counted.

    uvicorn itself raises the signal again once it has shut down, so the process would end killed
    by it (exit -15), which supervisors and Kubernetes report as a failure."""

    # uvicorn's own rule: only a second SIGINT (a second Ctrl-C) skips the drain.
    force_exit_signals: frozenset[int] = frozenset({signal.SIGINT})

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._stop_signals = 0  # SIGTERM/SIGINT received by this process itself

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._stop_signals += 1
        if self._stop_signals > 1 and sig in self.force_exit_signals:
            self.should_exit = True
            self.force_exit = True
            return
        self.begin_drain(f"Received {signal.Signals(sig).name}")

    def begin_drain(self, cause: str) -> None:
        """Start the drain `cause` asks for: here uvicorn's own graceful shutdown."""
        self.should_exit = True


REQUEST_ID_HEADER = b"x-request-id"
MAX_REQUEST_ID_LENGTH = 128
access_logger = logging.getLogger("berth.access")


class RequestIdMiddleware:
    """Every request has an id, in the `X-Request-Id` header of its response: the client's own
    (echoed), or a new one. It is set on the request too, so the router hands it to the rank and
    one id follows a request through both; the access log line and a 500's message carry it."""

    def __init__(self, app: Any, *, access_log: bool) -> None:
        self.app = app
        self.access_log = access_log

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope.get("headers") or [] if k != REQUEST_ID_HEADER]
        given = next((v for k, v in scope.get("headers") or [] if k == REQUEST_ID_HEADER), b"")
        request_id = given if _usable_id(given) else uuid.uuid4().hex.encode()
        scope = {**scope, "headers": [*headers, (REQUEST_ID_HEADER, request_id)]}
        status = 0

        async def send_with_id(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (REQUEST_ID_HEADER, request_id)]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.access_log:
                client = scope.get("client") or ("-", 0)
                access_logger.info(
                    '%s:%s - "%s %s" %s request_id=%s',
                    client[0],
                    client[1],
                    scope["method"],
                    scope["path"],
                    status or "-",
                    request_id.decode(),
                )


def _usable_id(value: bytes) -> bool:
    return 0 < len(value) <= MAX_REQUEST_ID_LENGTH and all(33 <= c < 127 for c in value)
