"""The body guard: bodies over the limit, malformed or hostile JSON refused before the app runs;
everything else reaches the app byte for byte."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import FastAPI, Request
from pydantic import BaseModel

from berth_common.body_guard import MAX_DEPTH, BodyGuardMiddleware, check_json
from berth_common.http import add_error_handlers

LIMIT = 1000


def app_behind_guard() -> tuple[BodyGuardMiddleware, list[bytes]]:
    app = FastAPI()
    add_error_handlers(app, "test error")
    seen: list[bytes] = []

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        seen.append(await request.body())
        return {"ok": True}

    return BodyGuardMiddleware(app, lambda: LIMIT), seen


async def post(
    content: object, headers: dict[str, str] | None = None
) -> tuple[httpx.Response, list[bytes]]:
    guard, seen = app_behind_guard()
    transport = httpx.ASGITransport(app=guard)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.post("/echo", content=content, headers=headers or {})
    return response, seen


async def test_a_good_body_reaches_the_app_unchanged() -> None:
    body = json.dumps({"messages": [{"content": "é\u00e9 \U0001f600"}], "n": 2**63 - 1}).encode()
    response, seen = await post(body, {"content-type": "application/json"})
    assert response.status_code == 200 and seen == [body]


async def test_over_the_limit_is_413_and_the_app_never_runs() -> None:
    response, seen = await post(b"x" * (LIMIT + 1))
    assert response.status_code == 413 and seen == []
    assert response.json()["error"]["code"] == "request_too_large"

    async def stream():  # no Content-Length: counted as it arrives
        for _ in range(20):
            yield b"y" * 100

    response, seen = await post(stream())
    assert response.status_code == 413 and seen == []


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (b'{"a": [1, {"b": "\\ud800"}]}', "a.1.b", "surrogate"),
        (b'{"\\udc00": 1}', None, "field name"),
        (b'{"priority": 9223372036854775808}', "priority", "out of range"),
        (b'{"x": -9223372036854775809}', "x", "out of range"),
        (b"[" * (MAX_DEPTH + 2) + b"]" * (MAX_DEPTH + 2), None, "deeper"),
        (b"[" * 100_000 + b"]" * 100_000, None, "deeper"),
        (b'{"model": "\xff"}', None, "UTF-8"),
    ],
)
def test_hostile_json_is_a_400_that_names_the_field(
    body: bytes, param: str | None, words: str
) -> None:
    problem = check_json(body)
    assert problem is not None and problem.status_code == 400
    assert problem.param == param and words in problem.message


def test_edges_that_are_fine() -> None:
    assert check_json(b'{"n": 9223372036854775807, "m": -9223372036854775808}') is None
    assert check_json(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) is None
    assert check_json(b'{"emoji": "\\ud83d\\ude00"}') is None  # a surrogate pair is a character
    problem = check_json(b'{"model": "m",\n "n": 1,}')
    assert problem is not None and problem.status_code == 400
    assert "not valid JSON" in problem.message and "line 2, column 9" in problem.message


class TypedBody(BaseModel):  # at module level: FastAPI resolves the annotation by name
    n: int


async def test_json_sent_as_a_form_reaches_the_app_as_json() -> None:
    """`curl -d` declares form-urlencoded; the routes must still read the body as JSON."""
    app = FastAPI()
    add_error_handlers(app, "test error")

    @app.post("/typed")
    async def typed(body: TypedBody, request: Request) -> dict:
        return {"n": body.n, "content_type": request.headers["content-type"]}

    transport = httpx.ASGITransport(app=BodyGuardMiddleware(app, lambda: LIMIT))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        for content_type in ("application/x-www-form-urlencoded", None):
            headers = {"content-type": content_type} if content_type else {}
            response = await client.post("/typed", content=b'{"n": 7}', headers=headers)
            assert response.json() == {"n": 7, "content_type": "application/json"}, content_type
        not_json = await client.post(
            "/typed", content=b"n=7", headers={"content-type": "application/x-www-form-urlencoded"}
        )
        assert not_json.status_code == 400
        assert "not valid JSON" in not_json.json()["error"]["message"]
        # A declared JSON body keeps its header as sent.
        response = await client.post(
            "/typed",
            content=b'{"n": 1}',
            headers={"content-type": "application/json; charset=utf-8"},
        )
        assert response.json() == {"n": 1, "content_type": "application/json; charset=utf-8"}
