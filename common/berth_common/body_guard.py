"""Refuse a request body that would cost more than it could ever be worth, before any work.

An ASGI middleware for `berth serve` and `berth router`. Before the app sees a body it checks:

- its size: past the limit, 413 as soon as the `Content-Length` or the bytes received say so,
  without reading the rest into memory;
- that a JSON body is JSON in UTF-8 (a 400 naming the line and column where it is not), nested
  at most MAX_DEPTH deep (Python's parser would otherwise recurse until it fails), with no lone
  UTF-16 surrogate in any string (`"\\ud800"` parses, but no tokenizer or encoder can take it)
  and no integer beyond 64 bits (the engine's messages carry int64).

Each refusal is a 400 or 413 with OpenAI's error body, `param` naming the field (`messages.0.
content`). A body sent without a JSON content type (`curl -d` says form-urlencoded) is checked as
JSON and handed on as `application/json`, so that the OpenAI routes parse it as llama.cpp's and
the native `/generate` do. Parsing and checking run in a worker thread, so a large body does not
hold up the event loop (and `/health`) while it is read.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from berth_common.errors import RequestError
from berth_common.http import error_response

MAX_DEPTH = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class BodyGuardMiddleware:
    """Reads each body (up to `max_bytes()`), checks it, then hands it to the app unchanged."""

    def __init__(self, app: Any, max_bytes: Callable[[], int]) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes()
        headers = dict(scope.get("headers") or [])
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        if declared > limit:
            await error_response(too_large(limit))(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await error_response(too_large(limit))(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        content_type = headers.get(b"content-type", b"")
        if body and is_json(content_type):
            problem = await asyncio.to_thread(check_json, body)
            if problem is not None:
                await error_response(problem)(scope, receive, send)
                return
            if media_type(content_type) != JSON_MEDIA_TYPE:
                scope = with_json_content_type(scope)

        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: a disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def too_large(limit: int) -> RequestError:
    return RequestError(
        f"the request body is larger than this server's limit of {limit} bytes",
        413,
        err_type="BadRequestError",
        code="request_too_large",
    )


JSON_MEDIA_TYPE = b"application/json"


def media_type(content_type: bytes) -> bytes:
    return content_type.split(b";", 1)[0].strip().lower()


def is_json(content_type: bytes) -> bool:
    # Clients that send JSON without saying so (curl -d) get it read as JSON all the same.
    return media_type(content_type) in (b"", JSON_MEDIA_TYPE, b"application/x-www-form-urlencoded")


def with_json_content_type(scope: dict) -> dict:
    """`scope` with its body declared JSON, so that the routes' body parsing reads it."""
    headers = [(k, v) for k, v in scope.get("headers") or [] if k.lower() != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", JSON_MEDIA_TYPE)]}


def check_json(body: bytes) -> RequestError | None:
    """What is wrong with a JSON body: not JSON, or JSON the routes' parser would choke on;
    None if nothing."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return RequestError(f"the request body is not valid UTF-8 (byte {e.start})")
    try:
        value = json.loads(text)
    except RecursionError:
        return too_deep()
    except json.JSONDecodeError as e:
        return RequestError(
            f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})"
        )
    return check_value(value)


def too_deep() -> RequestError:
    return RequestError(f"the request body nests deeper than {MAX_DEPTH} levels")


def check_value(root: Any) -> RequestError | None:
    """Walk a parsed body without recursion: depth, lone surrogates, integers beyond int64."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(root, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_DEPTH:
            return too_deep()
        if isinstance(value, dict):
            for key, item in value.items():
                if not _encodable(key):
                    return RequestError("a field name is not valid Unicode", param=_dotted(path))
                stack.append((item, (*path, key)))
        elif isinstance(value, list):
            stack.extend((item, (*path, str(i))) for i, item in enumerate(value))
        elif isinstance(value, str):
            if not _encodable(value):
                return RequestError(
                    "a string holds a lone UTF-16 surrogate (such as \\ud800): not valid Unicode",
                    param=_dotted(path),
                )
        elif isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
            return RequestError(
                f"the integer {_short(value)} is out of range (64-bit signed at most)",
                param=_dotted(path),
            )
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _dotted(path: tuple[str, ...]) -> str | None:
    return ".".join(path) if path else None


def _short(value: int) -> str:
    digits = str(value)
    return digits if len(digits) <= 24 else f"{digits[:10]}...({len(digits)} digits)"
