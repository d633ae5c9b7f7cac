"""API errors, classified by what can be done about them (answers as the real API server gives
them: tests/cluster/ provokes each one)."""

from __future__ import annotations

import json

from berth_operator.k8s import ApiError, _api_error


def error(code: int, reason: str, message: str, causes: list[dict[str, str]] | None = None):
    body = {"kind": "Status", "code": code, "reason": reason, "message": message}
    if causes is not None:
        body["details"] = {"causes": causes}
    return _api_error(code, "", json.dumps(body).encode())


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
