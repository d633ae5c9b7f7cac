"""The one Kubernetes API client: where the server is, how to log in, calls and their errors.

The operator (server-side apply, reads, status) and the router (EndpointSlice discovery) both talk
to the API server through this module: one httpx transport, one way to authenticate, one error
type classified by what the caller can do about it. It needs no Kubernetes client library, so the
router image stays small. Reading a kubeconfig (exec plugins, inline certificates) is the
operator's business and stays there; this module takes what it found as an `ApiServer`.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
JSON_CONTENT_TYPE = "application/json"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MERGE_CONTENT_TYPE = "application/merge-patch+json"
# Server-side apply answers 500 when it cannot even type the applied object: an unknown field in
# a pass-through part of the spec (affinity, valueFrom, ...) or a duplicate key in a keyed list.
# The same object always fails the same way, so it is the object's fault, not the server's.
UNTYPABLE_PREFIX = "failed to create typed patch object"


class NoApiServer(Exception):
    """Neither a URL was given nor does this process run in a pod."""


@dataclass(frozen=True)
class ApiServer:
    """Where an API server is and how to authenticate to it.

    `token` is called for every request, not once: bound service-account tokens rotate on disk,
    and a kubeconfig's exec plugin hands out short-lived ones.
    """

    url: str
    ca_path: str | None = None
    insecure: bool = False
    token: Callable[[], str | None] | None = None
    cert_path: str | None = None
    key_path: str | None = None

    @classmethod
    def in_cluster(cls, url: str | None = None) -> ApiServer:
        """The pod's own API server and service account; `url` overrides where (a `kubectl
        proxy` in development), and the account's token is still sent if the pod has one."""
        sa = SERVICE_ACCOUNT_DIR
        if url is None:
            host = os.environ.get("KUBERNETES_SERVICE_HOST")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if host:
                host = f"[{host}]" if ":" in host else host
                url = f"https://{host}:{port}"
            elif (sa / "token").exists():
                url = "https://kubernetes.default.svc"
            else:
                raise NoApiServer("not in a pod ($KUBERNETES_SERVICE_HOST unset, no token)")
        token_file = sa / "token"
        ca = sa / "ca.crt"
        return cls(
            url.rstrip("/"),
            ca_path=str(ca) if ca.exists() and url.startswith("https") else None,
            token=token_reader(token_file) if token_file.exists() else None,
        )

    def headers(self) -> dict[str, str]:
        headers = {"Accept": JSON_CONTENT_TYPE}
        token = self.token() if self.token is not None else None
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_path)
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if self.cert_path:
            context.load_cert_chain(self.cert_path, self.key_path)
        return context

    def client(
        self, timeout: httpx.Timeout, transport: httpx.AsyncBaseTransport | None = None
    ) -> httpx.AsyncClient:
        """An httpx client for this server; every request it sends carries fresh credentials."""
        return httpx.AsyncClient(
            base_url=self.url,
            verify=self.ssl_context() if self.url.startswith("https") else True,
            timeout=timeout,
            auth=_FreshHeaders(self),
            transport=transport,
        )


def token_reader(path: Path) -> Callable[[], str | None]:
    """A token read from `path` at each call (the kubelet rewrites bound tokens in place)."""

    def read() -> str | None:
        try:
            return path.read_text().strip() or None
        except OSError:
            return None

    return read


def pod_namespace() -> str | None:
    """The namespace this pod runs in, from its service account; None outside a pod."""
    try:
        return (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip() or None
    except OSError:
        return None


class _FreshHeaders(httpx.Auth):
    def __init__(self, server: ApiServer) -> None:
        self.server = server

    def auth_flow(self, request: httpx.Request):  # type: ignore[override]
        for key, value in self.server.headers().items():
            request.headers.setdefault(key, value)
        yield request


class ApiError(Exception):
    """A failed API call, with the HTTP status and the API server's own message and causes.

    `status` 0 is a call that got no answer (connection refused, timed out, reset).
    """

    def __init__(
        self,
        status: int,
        reason: str,
        message: str,
        causes: list[dict[str, Any]] | None = None,
    ) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        self.causes = causes or []
        super().__init__(f"{status} {reason}: {message}")

    @classmethod
    def from_response(cls, status: int, reason: str, body: bytes | str | None) -> ApiError:
        """Read the API server's `Status` object out of an error answer."""
        message = ""
        causes: list[dict[str, Any]] = []
        if body:
            try:
                payload = json.loads(body)
                message = payload.get("message") or ""
                reason = payload.get("reason") or reason
                causes = list((payload.get("details") or {}).get("causes") or [])
            except (ValueError, AttributeError):
                message = body.decode(errors="replace") if isinstance(body, bytes) else str(body)
        return cls(status, reason, message[:2000], causes)

    @property
    def invalid(self) -> bool:
        """The API server refused the object itself: sending it again cannot help."""
        return self.status in (400, 422) or (
            self.status == 500 and self.message.startswith(UNTYPABLE_PREFIX)
        )

    @property
    def field_conflict(self) -> bool:
        """Server-side apply: another field manager owns a field this apply sets (409)."""
        return self.status == 409 and self.reason == "Conflict" and bool(self.conflicts)

    @property
    def conflicts(self) -> list[tuple[str, str]]:
        """(field, "conflict with <manager> ...") for each field another manager owns."""
        return [
            (cause.get("field", ""), cause.get("message", ""))
            for cause in self.causes
            if cause.get("reason") == "FieldManagerConflict"
        ]

    @property
    def already_exists(self) -> bool:
        return self.status == 409 and self.reason == "AlreadyExists"

    @property
    def expired(self) -> bool:
        """A watch or list from a resourceVersion the server no longer has: list again (410)."""
        return self.status == 410

    @property
    def forbidden(self) -> bool:
        """RBAC, a ResourceQuota or an admission webhook said no (403)."""
        return self.status == 403

    @property
    def namespace_terminating(self) -> bool:
        """Nothing new may be created in a namespace that is being deleted (403)."""
        return self.status == 403 and any(
            cause.get("reason") == "NamespaceTerminating" for cause in self.causes
        )

    @property
    def transient(self) -> bool:
        """Worth the same call again later: the server (or the way to it) failed, or throttles."""
        return self.status == 0 or self.status == 429 or (self.status >= 500 and not self.invalid)


async def call(
    client: httpx.AsyncClient,
    method: str,
    path: str,
    *,
    query: list[tuple[str, str]] | Mapping[str, str] | None = None,
    body: Any = None,
    content_type: str = JSON_CONTENT_TYPE,
) -> dict[str, Any]:
    """One API call; the decoded answer, or `ApiError` (status 0 when nothing answered)."""
    headers = {"Content-Type": content_type} if body is not None else {}
    try:
        response = await client.request(
            method,
            path,
            params=query,
            headers=headers,
            content=json.dumps(body) if body is not None else None,
        )
    except httpx.TransportError as e:  # refused, reset, timed out: no answer at all
        raise ApiError(0, type(e).__name__, str(e)) from e
    if not response.is_success:
        raise ApiError.from_response(response.status_code, response.reason_phrase, response.content)
    return response.json() if response.content else {}
