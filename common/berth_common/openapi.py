"""The OpenAPI documents of `berth serve` and `berth router`: what each route really answers.

FastAPI's generated document describes FastAPI's defaults: a 422 with its own error shape on every
route with a body, JSON for every answer, no error a route raises itself. Berth answers 400 with
OpenAI's error body instead, and 401, 403, 404, 413 and 503 where they apply. Routes declare their
answers with `answers(...)`, and `honest_openapi` removes what FastAPI adds that never happens.
schemathesis checks the result against the running servers (tests/integration/test_openapi.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

DESCRIPTIONS = {
    400: "The request is invalid; `error.param` names the field",
    401: "The API key is missing or wrong",
    403: "The route needs the admin API key",
    404: "No such model, adapter, request or route",
    409: "The name is taken (an adapter of that name is loaded)",
    413: "The request body is larger than the server accepts",
    500: "The server failed; the body carries an error id, the log the details",
    502: "The rank that served the request failed (router)",
    503: "Not ready, draining or full: retry after `Retry-After` seconds",
    504: "The rank did not answer in time (router)",
}
RETRY_AFTER = {
    "Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "string"}}
}


OBJECT = {"type": "object"}
SSE = ("text/event-stream",)
METRICS_ANSWER: dict[int | str, Any] = {
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus"}
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


def answers(*codes: int, ok: Any = None, ok_media: tuple[str, ...] = ()) -> dict[int, Any]:
    """`responses=` for a route: its 200 (`ok`: a model, or a JSON schema) and its errors."""
    responses: dict[int, Any] = {}
    if ok is not None or ok_media:
        content: dict[str, Any] = {}
        if isinstance(ok, type) and issubclass(ok, BaseModel):
            responses[200] = {"model": ok}
        elif ok is not None:
            content["application/json"] = {"schema": ok}
        for media in ok_media:  # SSE: JSON chunks, then `[DONE]`; each chunk's shape varies
            content[media] = {"schema": {}}
        if content:
            responses.setdefault(200, {})["content"] = content
    for code in codes:
        response: dict[str, Any] = {"model": ErrorResponse, "description": DESCRIPTIONS[code]}
        if code == 503:
            response["headers"] = RETRY_AFTER
        responses[code] = response
    return responses


def plain_answers(responses: dict[int, Any], plain: dict[int, str]) -> dict[int, Any]:
    """`responses` plus statuses whose body is a plain JSON object, not an error body
    (`plain`: status -> description; `{"success": false}` from an abort that found nothing)."""
    for status, description in plain.items():
        responses[status] = {
            "description": description,
            "content": {"application/json": {"schema": OBJECT}},
        }
    return responses


def honest_openapi(app: FastAPI, bodies: Mapping[str, type[BaseModel]] | None = None) -> None:
    """Drop FastAPI's 422 and its validation-error schemas from `app`'s document (validation
    errors are 400s here, declared by each route), and describe the JSON bodies of POST routes
    that parse their body themselves (`bodies`: path -> the model that describes it)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = generate()
        for operations in document.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        for path, model in (bodies or {}).items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            ref = {"$ref": f"#/components/schemas/{model.__name__}"}
            document["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": ref}},
            }
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]
