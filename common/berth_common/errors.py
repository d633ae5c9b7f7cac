"""Errors a request can end with, and the OpenAI-style error body they become."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any


class RequestError(Exception):
    """A request the server will not serve; carries the HTTP status and OpenAI error fields."""

    def __init__(
        self,
        message: str,
        status_code: int = HTTPStatus.BAD_REQUEST,
        *,
        err_type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = int(status_code)
        self.err_type = err_type or _default_type(self.status_code)
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.status_code, self.param, self.code)


class EngineDeadError(RequestError):
    """A scheduler or detokenizer process died; nothing can be served any more."""

    def __init__(self, message: str = "the inference engine is not running") -> None:
        super().__init__(message, HTTPStatus.INTERNAL_SERVER_ERROR, err_type="engine_dead")


def _default_type(status_code: int) -> str:
    if status_code == HTTPStatus.NOT_FOUND:
        return "NotFoundError"
    if status_code == HTTPStatus.UNAUTHORIZED:
        return "AuthenticationError"
    if status_code == HTTPStatus.SERVICE_UNAVAILABLE:
        return "ServiceUnavailableError"
    if status_code >= 500:
        return "InternalServerError"
    return "BadRequestError"


def error_body(
    message: str,
    err_type: str,
    status_code: int,
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    """OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`: what the openai SDK
    and the clients built on it parse (also as an event of a stream that fails)."""
    return {
        "error": {
            "message": message,
            "type": err_type,
            "param": param,
            "code": code if code is not None else status_code,
        }
    }
