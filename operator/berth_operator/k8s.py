"""The only module that calls the API server: server-side apply, reads, prune and status patches.

It uses the official `kubernetes` client's transport (authentication, TLS, token refresh) with raw
paths, so one code path serves every kind. The client is synchronous; each call runs in a thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf
import kubernetes.client
import kubernetes.config
from kubernetes.client.exceptions import ApiException

from berth_operator import constants as c

logger = logging.getLogger(__name__)

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MERGE_CONTENT_TYPE = "application/merge-patch+json"
# (connect, read) seconds: a stuck API call must not hold a reconcile forever.
REQUEST_TIMEOUT = (5.0, 30.0)


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
ROLE = ResourceType("rbac.authorization.k8s.io", "v1", "roles", "Role")
ROLE_BINDING = ResourceType("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding")
INFERENCESERVICE = ResourceType(c.GROUP, c.VERSION, c.PLURAL, c.KIND)

# The kinds the builders may emit. The rank StatefulSet always exists (one per InferenceService,
# named after it), so `prune` only looks for leftovers of the kinds that come and go.
CHILD_TYPES = (
    SERVICE,
    STATEFULSET,
    DEPLOYMENT,
    PDB,
    INGRESS,
    SERVICE_ACCOUNT,
    ROLE,
    ROLE_BINDING,
)
PRUNED_TYPES = (SERVICE, DEPLOYMENT, PDB, INGRESS, SERVICE_ACCOUNT, ROLE, ROLE_BINDING)
_BY_KIND = {(t.api_version, t.kind): t for t in (*CHILD_TYPES, POD, INFERENCESERVICE)}


def resource_type(obj: Mapping[str, Any]) -> ResourceType:
    try:
        return _BY_KIND[obj["apiVersion"], obj["kind"]]
    except KeyError:
        raise ValueError(f"unknown kind {obj.get('apiVersion')} {obj.get('kind')}") from None


class ApiError(Exception):
    """A failed API call, with the HTTP status and the API server's own message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        super().__init__(f"{status} {reason}: {message}")

    @property
    def invalid(self) -> bool:
        """The API server refused the object itself (422): retrying the same object cannot help."""
        return self.status == 422


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

    async def apply(self, obj: Mapping[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        """Server-side apply `obj` with the operator's field manager, taking over conflicts."""
        return await asyncio.to_thread(self._apply, obj, dry_run)

    def _apply(self, obj: Mapping[str, Any], dry_run: bool) -> dict[str, Any]:
        rtype = resource_type(obj)
        meta = obj["metadata"]
        query = [("fieldManager", c.FIELD_MANAGER), ("force", "true")]
        if dry_run:
            query.append(("dryRun", "All"))
        path = rtype.path(meta.get("namespace"), meta["name"])
        try:
            return self._call("PATCH", path, query, obj, APPLY_CONTENT_TYPE)
        except ApiError as e:
            if e.status != 404:
                raise
        # A real API server creates a missing object on apply. API emulators without server-side
        # apply (kmock) answer 404 instead: create it, which is what apply would have done.
        create_query = [q for q in query if q[0] != "force"]
        return self._call("POST", rtype.path(meta.get("namespace")), create_query, obj)

    async def get(self, rtype: ResourceType, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await asyncio.to_thread(self._call, "GET", rtype.path(namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(
        self, rtype: ResourceType, namespace: str, selector: Mapping[str, str]
    ) -> list[dict[str, Any]]:
        """Objects matching `selector` (also checked here, for servers that ignore selectors)."""
        query = [("labelSelector", ",".join(f"{k}={v}" for k, v in sorted(selector.items())))]
        result = await asyncio.to_thread(self._call, "GET", rtype.path(namespace), query)
        items = result.get("items") or []
        return [
            item
            for item in items
            if all(
                ((item.get("metadata") or {}).get("labels") or {}).get(k) == v
                for k, v in selector.items()
            )
        ]

    async def delete(
        self, rtype: ResourceType, namespace: str, name: str, *, uid: str | None = None
    ) -> None:
        """Delete `name` (gone already is fine); with `uid`, only that very object, not a
        successor of the same name (a StatefulSet pod recreated meanwhile)."""
        body = {"preconditions": {"uid": uid}} if uid else None
        try:
            await asyncio.to_thread(
                self._call,
                "DELETE",
                rtype.path(namespace, name),
                [("propagationPolicy", "Background")],
                body,
            )
        except ApiError as e:
            if e.status not in (404, 409):  # 409: the precondition failed, a successor lives
                raise

    async def patch_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        """Merge-patch the InferenceService's status subresource (never its spec)."""
        await asyncio.to_thread(
            self._call,
            "PATCH",
            INFERENCESERVICE.path(namespace, name, "status"),
            [],
            {"status": dict(patch)},
            MERGE_CONTENT_TYPE,
        )

    async def prune(
        self,
        namespace: str,
        owner_labels: Mapping[str, str],
        owner_uid: str | None,
        keep: Iterable[Mapping[str, Any]],
    ) -> list[tuple[str, str]]:
        """Delete the owner's children that `keep` no longer contains; return (kind, name)s."""
        wanted = {(o["kind"], o["metadata"]["name"]) for o in keep}
        deleted = []
        for rtype in PRUNED_TYPES:
            for item in await self.list(rtype, namespace, owner_labels):
                meta = item.get("metadata") or {}
                if (rtype.kind, meta.get("name")) in wanted:
                    continue
                owners = [ref.get("uid") for ref in meta.get("ownerReferences") or []]
                if owner_uid is not None and owner_uid not in owners:
                    continue  # labelled like ours, but not ours: leave it alone
                await self.delete(rtype, namespace, meta["name"])
                deleted.append((rtype.kind, meta["name"]))
        return deleted

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
        if not 200 <= response.status < 300:
            raise _api_error(response.status, response.reason or "", data)
        return json.loads(data) if data else {}


def _api_error(status: int, reason: str, body: Any) -> ApiError:
    message = ""
    if body:
        try:
            payload = json.loads(body)
            message = payload.get("message") or ""
            reason = payload.get("reason") or reason
        except (ValueError, AttributeError):
            message = body.decode(errors="replace") if isinstance(body, bytes) else str(body)
    return ApiError(status, reason, message[:2000])
