"""API keys for `berth serve` and `berth router`: a serving key, an admin key, and who may do what.

Two keys, as SGLang's `--admin-api-key`: the serving key (`--api-key`) is what applications hold;
the admin key (`--admin-api-key`) alone may flush caches or abort every request. A server with a
serving key but no admin key keeps its admin routes closed, so that handing out the serving key
never hands out control of the server. A server with no key at all (a laptop) is open.

Keys come from a flag, a file (`--api-key-file`: a mounted Secret) or the environment.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from berth_common.errors import RequestError, error_body

ADMIN = "admin"
USER = "user"
ROLE_SCOPE_KEY = "berth_role"


def resolve_key(flag: str, value: str | None, path: str | None, env: str) -> str | None:
    """The key from `--<flag>`, else from `--<flag>-file`, else from $`env`; a file read once, at
    start. Both a value and a file is a mistake worth an error, not a silent precedence."""
    if value is not None and path is not None:
        raise ValueError(f"--{flag} and --{flag}-file are exclusive; give one")
    if path is not None:
        try:
            key = open(path, encoding="utf-8").read().strip()  # noqa: SIM115 - read once
        except OSError as e:
            raise ValueError(f"--{flag}-file {path}: {e.strerror or e}") from None
        if not key:
            raise ValueError(f"--{flag}-file {path} is empty")
        return key
    if value is not None:
        if not value.strip():
            raise ValueError(f"--{flag} is empty")
        return value
    return os.environ.get(env) or None


def settle_keys(args: Any) -> None:
    """Fill a frozen args dataclass's `api_key` and `admin_api_key` from their flags, files or
    environment (`ServerArgs` and `RouterArgs` share the four fields)."""
    api_key = resolve_key("api-key", args.api_key, args.api_key_file, "BERTH_API_KEY")
    object.__setattr__(args, "api_key", api_key)
    admin_key = resolve_key(
        "admin-api-key", args.admin_api_key, args.admin_api_key_file, "BERTH_ADMIN_API_KEY"
    )
    object.__setattr__(args, "admin_api_key", admin_key)


@dataclass(frozen=True)
class Keys:
    """The serving key and the admin key (either may be unset)."""

    api_key: str | None = None
    admin_api_key: str | None = None

    def role(self, authorization: bytes) -> str | None:
        """ADMIN, USER, or None (no valid key where one is required)."""
        if self.api_key is None and self.admin_api_key is None:
            return ADMIN
        if self.admin_api_key is not None and _matches(authorization, self.admin_api_key):
            return ADMIN
        if self.api_key is None or _matches(authorization, self.api_key):
            return USER
        return None

    def admin_refusal(self) -> str:
        if self.admin_api_key is None:
            return "this route is for administrators: start the server with --admin-api-key"
        return "this route needs the admin API key"


def _matches(authorization: bytes, key: str) -> bool:
    return hmac.compare_digest(authorization, f"Bearer {key}".encode())


class ApiKeyMiddleware:
    """Pure ASGI (keeps `request.is_disconnected()` working). Paths in `open_paths` (probes and
    scrapers) need no key; paths in `admin_paths` need the admin key; every other path needs the
    serving key (or the admin key). The caller's role is left in the scope for routes whose
    admin-ness depends on the body (`require_admin`)."""

    def __init__(
        self,
        app: Any,
        keys: Keys,
        open_paths: frozenset[str],
        admin_paths: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths
        self.admin_paths = admin_paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            role = self.keys.role(given)
            path = scope["path"]
            if path in self.open_paths:
                pass
            elif role is None:
                body = error_body("invalid or missing API key", "AuthenticationError", 401)
                headers = {"WWW-Authenticate": "Bearer"}
                await JSONResponse(body, status_code=401, headers=headers)(scope, receive, send)
                return
            elif path in self.admin_paths and role != ADMIN:
                body = error_body(self.keys.admin_refusal(), "PermissionDeniedError", 403)
                await JSONResponse(body, status_code=403)(scope, receive, send)
                return
            scope.setdefault("state", {})[ROLE_SCOPE_KEY] = role
        await self.app(scope, receive, send)


def require_admin(request: Request, keys: Keys, param: str) -> None:
    """403 unless the caller holds the admin key (`param`: the field that made it admin-only)."""
    if request.scope.get("state", {}).get(ROLE_SCOPE_KEY) != ADMIN:
        raise RequestError(keys.admin_refusal(), 403, err_type="PermissionDeniedError", param=param)
