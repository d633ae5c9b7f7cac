"""API errors, classified by what can be done about them (answers as the real API server gives
them: tests/cluster/ provokes each one)."""

from __future__ import annotations

import json

import httpx
import pytest

from berth_common.kube import MERGE_CONTENT_TYPE, ApiError, ApiServer, call, token_reader


def error(code: int, reason: str, message: str, causes: list[dict[str, str]] | None = None):
    body = {"kind": "Status", "code": code, "reason": reason, "message": message}
    if causes is not None:
        body["details"] = {"causes": causes}
    return ApiError.from_response(code, "", json.dumps(body).encode())


def test_a_field_manager_conflict_names_the_field_and_the_manager() -> None:
    e = error(
        409,
        "Conflict",
        'Apply failed with 1 conflict: conflict with "kubectl" with subresource "scale"',
        [
            {
                "reason": "FieldManagerConflict",
                "message": 'conflict with "kubectl" with subresource "scale" using apps/v1',
                "field": ".spec.replicas",
            }
        ],
    )
    assert e.field_conflict and not e.already_exists and not e.transient
    assert e.conflicts == [
        (".spec.replicas", 'conflict with "kubectl" with subresource "scale" using apps/v1')
    ]


def test_an_untypable_apply_is_the_objects_fault_not_the_servers() -> None:
    typo = error(
        500,
        "",
        "failed to create typed patch object (ns/x; apps/v1, Kind=StatefulSet): "
        ".spec.template.spec.affinity.nodeAfinity: field not declared in schema",
    )
    assert typo.invalid and not typo.transient
    assert error(500, "InternalError", "etcdserver: request timed out").transient
    assert error(422, "Invalid", "spec.replicas: Invalid value").invalid


def test_refusals_and_the_rest() -> None:
    quota = error(403, "Forbidden", 'deployments.apps "x" is forbidden: exceeded quota: q')
    assert quota.forbidden and not quota.transient and not quota.namespace_terminating
    terminating = error(
        403,
        "Forbidden",
        "unable to create new content in namespace t because it is being terminated",
        [{"reason": "NamespaceTerminating", "message": "", "field": "metadata.namespace"}],
    )
    assert terminating.namespace_terminating
    assert error(409, "AlreadyExists", 'statefulsets.apps "x" already exists').already_exists
    assert error(429, "TooManyRequests", "storage is (re)initializing").transient
    assert ApiError(0, "MaxRetryError", "connection refused").transient


async def test_a_call_sends_fresh_credentials_and_reads_the_status_back(tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path.endswith("/missing"):
            status = {"kind": "Status", "code": 404, "reason": "NotFound", "message": "not here"}
            return httpx.Response(404, json=status)
        if request.url.path.endswith("/down"):
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"echo": json.loads(request.content or b"null")})

    server = ApiServer("http://api", token=token_reader(token))
    async with server.client(httpx.Timeout(5.0), httpx.MockTransport(answer)) as client:
        body = {"metadata": {"name": "x"}}
        assert await call(client, "PATCH", "/ok", body=body, content_type=MERGE_CONTENT_TYPE) == {
            "echo": body
        }
        token.write_text("rotated")
        with pytest.raises(ApiError) as missing:
            await call(client, "GET", "/missing")
        with pytest.raises(ApiError) as down:
            await call(client, "GET", "/down")
    assert (missing.value.status, missing.value.reason, missing.value.message) == (
        404,
        "NotFound",
        "not here",
    )
    assert down.value.status == 0 and down.value.transient
    assert [r.headers["authorization"] for r in seen] == [
        "Bearer first",
        "Bearer rotated",
        "Bearer rotated",
    ]
    assert seen[0].headers["content-type"] == MERGE_CONTENT_TYPE
