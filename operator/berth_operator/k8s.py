"""The operator's API calls: server-side apply, reads, deletes, status patches, by resource type.

Calls go through `berth_common.kube`, the client the router uses too, with raw paths, so one code
path serves every kind. From the official `kubernetes` package only the kubeconfig loader is used
(exec plugins, inline certificates), when the operator runs outside a pod. Nothing here retries
or second-guesses an answer: an error comes back as `ApiError`, classified by what the caller can
do about it (`children` and `worker` decide).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import kopf

from berth_common.kube import (
    APPLY_CONTENT_TYPE,
    MERGE_CONTENT_TYPE,
    ApiError,
    ApiServer,
    NoApiServer,
    call,
)
from berth_operator import constants as c

__all__ = ["ApiError", "Kube", "ResourceType", "resource_type"]

logger = logging.getLogger(__name__)

# A stuck API call must not hold a reconcile forever.
REQUEST_TIMEOUT = httpx.Timeout(30.0, connect=5.0)


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
ACCELERATORPOOL = ResourceType(c.GROUP, c.VERSION, c.POOL_PLURAL, c.POOL_KIND, namespaced=False)
# The Gateway API Inference Extension's pool: a child only where its CRD is installed, so it is
# not watched (`Worker` reads it when it reconciles).
INFERENCE_POOL = ResourceType(
    "inference.networking.k8s.io", "v1", "inferencepools", "InferencePool"
)

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
_BY_KIND = {
    (t.api_version, t.kind): t for t in (*CHILD_TYPES, INFERENCE_POOL, POD, INFERENCESERVICE)
}
KIND_TYPES = {t.kind: t for t in (*CHILD_TYPES, INFERENCE_POOL)}


def resource_type(obj: Mapping[str, Any]) -> ResourceType:
    try:
        return _BY_KIND[obj["apiVersion"], obj["kind"]]
    except KeyError:
        raise ValueError(f"unknown kind {obj.get('apiVersion')} {obj.get('kind')}") from None


class Kube:
    """An API-server connection for the operator's own calls (kopf keeps its own session)."""

    def __init__(self, server: ApiServer) -> None:
        self.server = server
        self.client = server.client(REQUEST_TIMEOUT)

    @classmethod
    def from_environment(cls) -> Kube:
        """In-cluster service account if present, else the kubeconfig ($KUBECONFIG or default)."""
        try:
            return cls(ApiServer.in_cluster())
        except NoApiServer:
            return cls(_from_kubeconfig(os.environ.get("KUBECONFIG") or None))

    @classmethod
    def for_url(cls, url: str, token: str | None = None) -> Kube:
        """A plain connection to `url` (an API emulator in tests, `kubectl proxy` in dev)."""
        return cls(ApiServer(url.rstrip("/"), token=(lambda: token) if token else None))

    def connection_info(self) -> kopf.ConnectionInfo:
        """The same credentials for kopf's own watches and patches (one login for both)."""
        server = self.server
        token = server.token() if server.token is not None else None
        return kopf.ConnectionInfo(
            server=server.url,
            ca_path=server.ca_path,
            insecure=server.insecure,
            scheme="Bearer" if token else None,
            token=token,
            certificate_path=server.cert_path,
            private_key_path=server.key_path,
        )

    async def close(self) -> None:
        await self.client.aclose()

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
        return await call(
            self.client, "PATCH", path, query=query, body=obj, content_type=APPLY_CONTENT_TYPE
        )

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
        return await call(self.client, "POST", path, query=query, body=obj)

    async def get(self, rtype: ResourceType, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await call(self.client, "GET", rtype.path(namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def serves(self, rtype: ResourceType) -> bool:
        """Whether the API server serves `rtype` (its CRD is installed): API discovery, which
        every authenticated user may read."""
        base = f"/apis/{rtype.group}/{rtype.version}" if rtype.group else f"/api/{rtype.version}"
        try:
            listing = await call(self.client, "GET", base)
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        return any(r.get("name") == rtype.plural for r in listing.get("resources") or ())

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
            await call(self.client, "DELETE", rtype.path(namespace, name), body=body)
        except ApiError as e:
            if e.status in (404, 409):  # 409: the precondition failed, a successor lives
                return False
            raise
        return True

    async def patch_status(
        self,
        namespace: str | None,
        name: str,
        patch: Mapping[str, Any],
        rtype: ResourceType = INFERENCESERVICE,
    ) -> dict[str, Any]:
        """Merge-patch the status subresource (never the spec) of an InferenceService (or of
        another of our kinds); returns the object as stored afterwards."""
        return await call(
            self.client,
            "PATCH",
            rtype.path(namespace, name, "status"),
            query=[("fieldManager", c.FIELD_MANAGER)],
            body={"status": dict(patch)},
            content_type=MERGE_CONTENT_TYPE,
        )


def _from_kubeconfig(path: str | None) -> ApiServer:
    """The kubeconfig's current context, read by the official loader (it runs exec plugins and
    writes inline certificates to files); its token is asked for again on every call."""
    import kubernetes.client
    import kubernetes.config

    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=path, client_configuration=configuration)

    def token() -> str | None:
        header = configuration.get_api_key_with_prefix("BearerToken")  # refreshes expiring ones
        return header.split(" ", 1)[-1] if header else None

    return ApiServer(
        configuration.host.rstrip("/"),
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        token=token,
        cert_path=configuration.cert_file,
        key_path=configuration.key_file,
    )
