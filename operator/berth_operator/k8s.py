"""The only module that calls the API server: server-side apply, reads, deletes, status patches.

It uses the official `kubernetes` client's transport (authentication, TLS, token refresh) with raw
paths, so one code path serves every kind. The client is synchronous; each call runs in a thread.
Nothing here retries or second-guesses an answer: an error comes back as `ApiError`, classified
by what the caller can do about it (`children` and `worker` decide).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf
import kubernetes.client
import kubernetes.config
import urllib3
from kubernetes.client.exceptions import ApiException

from berth_operator import constants as c

logger = logging.getLogger(__name__)

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MERGE_CONTENT_TYPE = "application/merge-patch+json"
# (connect, read) seconds: a stuck API call must not hold a reconcile forever.
REQUEST_TIMEOUT = (5.0, 30.0)
# Server-side apply answers 500 when it cannot even type the applied object: an unknown field in
# a pass-through part of the spec (affinity, valueFrom, ...) or a duplicate key in a keyed list.
# The same object always fails the same way, so it is the object's fault, not the server's.
UNTYPABLE_PREFIX = "failed to create typed patch object"


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def resource(self) -> str:
        """The name RBAC and kubectl use: `deployments.apps`, `services`."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def path(self, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace is not None:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name is not None:
            base += f"/{name}"
        if sub is not None:
            base += f"/{sub}"
        return base


SERVICE = ResourceType("", "v1", "services", "Service")
POD = ResourceType("", "v1", "pods", "Pod")
STATEFULSET = ResourceType("apps", "v1", "statefulsets", "StatefulSet")
DEPLOYMENT = ResourceType("apps", "v1", "deployments", "Deployment")
PDB = ResourceType("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget")
INGRESS = ResourceType("networking.k8s.io", "v1", "ingresses", "Ingress")
SERVICE_ACCOUNT = ResourceType("", "v1", "serviceaccounts", "ServiceAccount")
ROLE_BINDING = ResourceType("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding")
INFERENCESERVICE = ResourceType(c.GROUP, c.VERSION, c.PLURAL, c.KIND)

# The kinds the builders may emit; the operator watches each of them (drift repair, status).
CHILD_TYPES = (
    SERVICE,
    STATEFULSET,
    DEPLOYMENT,
    PDB,
    INGRESS,
    SERVICE_ACCOUNT,
    ROLE_BINDING,
)
_BY_KIND = {(t.api_version, t.kind): t for t in (*CHILD_TYPES, POD, INFERENCESERVICE)}
KIND_TYPES = {t.kind: t for t in CHILD_TYPES}


def resource_type(obj: Mapping[str, Any]) -> ResourceType:
    try:
        return _BY_KIND[obj["apiVersion"], obj["kind"]]
    except KeyError:
        raise ValueError(f"unknown kind {obj.get('apiVersion')} {obj.get('kind')}") from None


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


class Kube:
    """An API-server connection for the operator's own calls (kopf keeps its own session)."""

    def __init__(self, configuration: kubernetes.client.Configuration) -> None:
        self.configuration = configuration
        self.api = kubernetes.client.ApiClient(configuration)

    @classmethod
    def from_environment(cls) -> Kube:
        """In-cluster service account if present, else the kubeconfig ($KUBECONFIG or default)."""
        configuration = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(
                config_file=os.environ.get("KUBECONFIG") or None,
                client_configuration=configuration,
            )
        return cls(configuration)

    @classmethod
    def for_url(cls, url: str, token: str | None = None) -> Kube:
        """A plain connection to `url` (an API emulator in tests, `kubectl proxy` in dev)."""
        configuration = kubernetes.client.Configuration(host=url.rstrip("/"))
        if token:
            configuration.api_key["BearerToken"] = token
            configuration.api_key_prefix["BearerToken"] = "Bearer"
        return cls(configuration)

    def connection_info(self) -> kopf.ConnectionInfo:
        """The same credentials for kopf's own watches and patches (one login for both)."""
        cfg = self.configuration
        header = cfg.get_api_key_with_prefix("BearerToken")  # refreshes rotated tokens
        parts = header.split(" ", 1) if header else []
        scheme, token = (
            (None, None)
            if not parts
            else (None, parts[0])
            if len(parts) == 1
            else (parts[0], parts[1])
        )
        return kopf.ConnectionInfo(
            server=cfg.host,
            ca_path=cfg.ssl_ca_cert,
            insecure=not cfg.verify_ssl,
            username=cfg.username or None,
            password=cfg.password or None,
            scheme=scheme,
            token=token,
            certificate_path=cfg.cert_file,
            private_key_path=cfg.key_file,
        )

    def close(self) -> None:
        self.api.close()

    # --- calls -----------------------------------------------------------------------------------

    async def apply(
        self, obj: Mapping[str, Any], *, force: bool = False, dry_run: bool = False
    ) -> dict[str, Any]:
        """Server-side apply `obj` with the operator's field manager (creates it if missing).

        Without `force`, a field another manager owns is a 409 naming the field and the manager.
        `fieldValidation=Strict`: a field the child's schema does not know is an error, never a
        warning that nobody reads.
        """
        rtype = resource_type(obj)
        meta = obj["metadata"]
        query = [("fieldManager", c.FIELD_MANAGER), ("fieldValidation", "Strict")]
        if force:
            query.append(("force", "true"))
        if dry_run:
            query.append(("dryRun", "All"))
        path = rtype.path(meta.get("namespace"), meta["name"])
        return await asyncio.to_thread(self._call, "PATCH", path, query, obj, APPLY_CONTENT_TYPE)

    async def create_dry_run(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Validate `obj` as if it were new (nothing is stored): a valid object whose name is
        taken answers 409 AlreadyExists, an invalid one 422."""
        rtype = resource_type(obj)
        query = [
            ("fieldManager", c.FIELD_MANAGER),
            ("fieldValidation", "Strict"),
            ("dryRun", "All"),
        ]
        path = rtype.path(obj["metadata"].get("namespace"))
        return await asyncio.to_thread(self._call, "POST", path, query, obj)

    async def get(self, rtype: ResourceType, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await asyncio.to_thread(self._call, "GET", rtype.path(namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def delete(
        self,
        rtype: ResourceType,
        namespace: str,
        name: str,
        *,
        uid: str | None = None,
        propagation: str = "Background",
    ) -> bool:
        """Delete `name`; with `uid`, only that very object, never a successor of the same name.
        False if it was gone already (or a successor lives)."""
        body: dict[str, Any] = {"propagationPolicy": propagation}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            await asyncio.to_thread(self._call, "DELETE", rtype.path(namespace, name), [], body)
        except ApiError as e:
            if e.status in (404, 409):  # 409: the precondition failed, a successor lives
                return False
            raise
        return True

    async def patch_status(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Merge-patch the InferenceService's status subresource (never its spec); returns the
        InferenceService as stored afterwards."""
        return await asyncio.to_thread(
            self._call,
            "PATCH",
            INFERENCESERVICE.path(namespace, name, "status"),
            [("fieldManager", c.FIELD_MANAGER)],
            {"status": dict(patch)},
            MERGE_CONTENT_TYPE,
        )

    def _call(
        self,
        method: str,
        path: str,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if content_type is not None:
            headers["Content-Type"] = content_type
        elif body is not None:
            headers["Content-Type"] = "application/json"
        request = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or None,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            response = self.api.call_api(*request, _request_timeout=REQUEST_TIMEOUT)
            data = response.read()
        except ApiException as e:
            raise _api_error(e.status or 0, e.reason or "", e.body) from e
        except urllib3.exceptions.HTTPError as e:  # refused, reset, timed out: no answer at all
            raise ApiError(0, type(e).__name__, str(e)) from e
        if not 200 <= response.status < 300:
            raise _api_error(response.status, response.reason or "", data)
        return json.loads(data) if data else {}


def _api_error(status: int, reason: str, body: Any) -> ApiError:
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
    return ApiError(status, reason, message[:2000], causes)
