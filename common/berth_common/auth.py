"""ApiKeyMiddleware: the Bearer-key check shared by `berth serve` and `berth router`."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.responses import JSONResponse

from berth_common.errors import error_body


class ApiKeyMiddleware:
    """Pure ASGI (keeps `request.is_disconnected()` working): Bearer key on every path that is
    not in `open_paths` (probes and scrapers)."""

    def __init__(self, app: Any, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                body = error_body("invalid or missing API key", "AuthenticationError", 401)
                response = JSONResponse(
                    body, status_code=401, headers={"WWW-Authenticate": "Bearer"}
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
