"""The operator, with kopf running for real, against kmock's emulated Kubernetes API, for what
the real control plane in tests/cluster/ cannot show: ranks that are real `berth serve` processes,
whose /metrics the operator scrapes (autoscaling, stalls, imbalance). kwok's pods run nothing.

kmock quirks handled here (see ../shared/reference/testing-and-performance.md §1): it never sets
resourceVersion, uid or generation (the tests seed them, and bump generation on spec changes like
the API server does); it has no controllers (tests patch the children's status and make the pods);
and `ApplyingEmulator` gives it the two things of server-side apply the operator relies on: an
apply creates a missing object, and a dry run stores nothing. Its path parser reads
`/api/v1/namespaces` as the start of a namespaced path, so listing Namespaces (which the
operator watches for AcceleratorPools) is taught to it in `_parse_path`. Everything else about
server-side apply, admission, RBAC and garbage collection is tested against the real API server.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import aiohttp.web
import kmock
import kmock._internal.parsing as kmock_parsing
import kopf
import pytest

import berth_operator.handlers  # noqa: F401  (registers the handlers with kopf)
from berth_operator import constants as c
from berth_operator import naming
from berth_operator.k8s import Kube


class ApplyingEmulator(kmock.KubernetesEmulator):
    """kmock, plus: a server-side apply of a missing object creates it; a dry run stores
    nothing (and answers with the object sent)."""

    async def _handle(self, request: Any) -> aiohttp.web.StreamResponse:
        if request.resource is not None and request.params.get("dryRun"):
            return aiohttp.web.json_response(request.data or {})
        if (
            request.action == kmock.action.UPDATE
            and request.name is not None
            and request.subresource is None
            and request.headers.get("Content-Type", "").startswith("application/apply-patch")
        ):
            key = (request.resource, request.namespace, request.name)
            async with self._lock:
                if key not in self.objects or self.objects[key].deleted:
                    if key in self.objects:
                        self.objects[key].create(request.data)
                    else:
                        self.objects[key] = request.data
                    raw = self.objects[key].last.raw
                    await self._buses[request.resource].put({"type": "ADDED", "object": raw})
                    return aiohttp.web.json_response(raw, status=201)
        return await super()._handle(request)


_kmock_parse_path = kmock_parsing.parse_path


def _parse_path(path: str) -> Any:
    """`/api/v1/namespaces[/<name>]` is the cluster-scoped Namespaces resource."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
        name = parts[3] if len(parts) == 4 else None
        return kmock_parsing.ParsedPath("", "v1", "namespaces", None, name, None)
    return _kmock_parse_path(path)


kmock_parsing.parse_path = _parse_path

T = TypeVar("T")

ISVC = f"{c.GROUP}/{c.VERSION}/{c.PLURAL}"
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}
RESOURCES: dict[str, kmock.ResourceInfo] = {
    "v1/namespaces": kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs=VERBS),
    "v1/events": kmock.ResourceInfo(kind="Event", namespaced=True, verbs=VERBS),
    "v1/pods": kmock.ResourceInfo(kind="Pod", namespaced=True, verbs=VERBS),
    "v1/services": kmock.ResourceInfo(kind="Service", namespaced=True, verbs=VERBS),
    "v1/serviceaccounts": kmock.ResourceInfo(kind="ServiceAccount", namespaced=True, verbs=VERBS),
    "rbac.authorization.k8s.io/v1/rolebindings": kmock.ResourceInfo(
        kind="RoleBinding", namespaced=True, verbs=VERBS
    ),
    "apps/v1/statefulsets": kmock.ResourceInfo(
        kind="StatefulSet", namespaced=True, verbs=VERBS, subresources={"status", "scale"}
    ),
    "apps/v1/deployments": kmock.ResourceInfo(
        kind="Deployment", namespaced=True, verbs=VERBS, subresources={"status", "scale"}
    ),
    "policy/v1/poddisruptionbudgets": kmock.ResourceInfo(
        kind="PodDisruptionBudget", namespaced=True, verbs=VERBS, subresources={"status"}
    ),
    "networking.k8s.io/v1/ingresses": kmock.ResourceInfo(
        kind="Ingress", namespaced=True, verbs=VERBS, subresources={"status"}
    ),
    "v1/nodes": kmock.ResourceInfo(kind="Node", namespaced=False, verbs=VERBS),
    f"{c.GROUP}/{c.VERSION}/{c.POOL_PLURAL}": kmock.ResourceInfo(
        kind=c.POOL_KIND, namespaced=False, verbs=VERBS, subresources={"status"}
    ),
    "apiextensions.k8s.io/v1/customresourcedefinitions": kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=VERBS
    ),
    ISVC: kmock.ResourceInfo(
        kind=c.KIND,
        singular=c.SINGULAR,
        shortnames=set(c.SHORT_NAMES),
        namespaced=True,
        verbs=VERBS,
        subresources={"status", "scale"},
    ),
}
# Every watch the operator opens; it is ready once all of them stream.
WATCHED = (
    "inferenceservices",
    "statefulsets",
    "deployments",
    "services",
    "poddisruptionbudgets",
    "ingresses",
    "serviceaccounts",
    "rolebindings",
    "pods",
    "acceleratorpools",
    "nodes",
    "namespaces",
)
TIMEOUT = 10.0
NS = "team-a"
STS = "apps/v1/statefulsets"
DEPLOY = "apps/v1/deployments"


async def eventually(check: Callable[[], T], *, timeout: float = TIMEOUT, what: str = "") -> T:
    """Poll `check` until it returns a truthy value without raising; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
            error = None
        except (AssertionError, KeyError, LookupError) as e:
            error = e
        await asyncio.sleep(0.02)
    pytest.fail(f"timed out waiting for {what or check}: {error!r}")


class Cluster:
    """Test-side access to the emulated API: what a user, a controller or kubectl would do."""

    def __init__(self, api: kmock.KubernetesEmulator) -> None:
        self.api = api

    @property
    def url(self) -> str:
        return str(self.api.url).rstrip("/")

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        for (res, ns, obj_name), obj in self.api.objects.items():
            if obj_name == name and ns == namespace and _resource_str(res) == resource:
                return None if obj.deleted else copy.deepcopy(obj.raw)
        return None

    def names(self, resource: str, namespace: str) -> list[str]:
        return sorted(
            name
            for (res, ns, name), obj in self.api.objects.items()
            if ns == namespace and _resource_str(res) == resource and not obj.deleted
        )

    def snapshot(self) -> dict[tuple[str, str | None, str | None], dict[str, Any]]:
        return {
            (_resource_str(res), ns, name): copy.deepcopy(obj.raw)
            for (res, ns, name), obj in self.api.objects.items()
            if not obj.deleted and _resource_str(res) != "v1/events"
        }

    async def _send(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        async with self.api.request(method, path, json=body) as response:
            payload = await response.json()
            assert response.status < 300, (response.status, payload)
            return payload

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        api_version, kind = body["apiVersion"], body["kind"]
        plural = {"InferenceService": c.PLURAL, "Pod": "pods", "Service": "services"}[kind]
        base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
        ns = body["metadata"]["namespace"]
        meta = body["metadata"]
        meta.setdefault("uid", f"uid-{kind.lower()}-{meta['name']}")
        meta.setdefault("resourceVersion", "1")
        return await self._send("POST", f"{base}/namespaces/{ns}/{plural}", body)

    async def update_spec(self, namespace: str, name: str, spec: dict[str, Any]) -> None:
        """Like `kubectl apply` of a changed spec: the API server bumps metadata.generation."""
        current = self.get(ISVC, namespace, name)
        assert current is not None
        generation = current["metadata"].get("generation", 1) + 1
        await self._send(
            "PATCH",
            f"/apis/{ISVC.rsplit('/', 1)[0]}/namespaces/{namespace}/{c.PLURAL}/{name}",
            {"spec": spec, "metadata": {"generation": generation}},
        )

    async def patch_status(
        self, resource: str, namespace: str, name: str, status: dict[str, Any]
    ) -> None:
        """What a built-in controller (or the kubelet) would report."""
        group_version, plural = resource.rsplit("/", 1)
        base = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
        await self._send(
            "PATCH", f"{base}/namespaces/{namespace}/{plural}/{name}/status", {"status": status}
        )

    async def delete(self, resource: str, namespace: str, name: str) -> None:
        group_version, plural = resource.rsplit("/", 1)
        base = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
        await self._send("DELETE", f"{base}/namespaces/{namespace}/{plural}/{name}")

    def condition(self, namespace: str, name: str, type_: str) -> dict[str, Any]:
        obj = self.get(ISVC, namespace, name) or {}
        for cond in (obj.get("status") or {}).get("conditions") or []:
            if cond["type"] == type_:
                return cond
        return {}

    def requests(self, since: int = 0) -> list[Any]:
        return list(self.api)[since:]  # iterating kmock yields every request so far


def _resource_str(res: Any) -> str:
    return f"{res.group}/{res.version}/{res.plural}" if res.group else f"{res.version}/{res.plural}"


@pytest.fixture
def kmock_options(kmock_options: dict[str, Any]) -> dict[str, Any]:
    return {**kmock_options, "cls": ApplyingEmulator}


@pytest.fixture
async def cluster(kmock: kmock.KubernetesEmulator) -> Cluster:
    for key, info in RESOURCES.items():
        kmock.resources[key] = info
    return Cluster(kmock)


def isvc(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "metadata": {"name": name, "namespace": NS, "generation": 1},
        "spec": copy.deepcopy(spec),
    }


def reason(cluster: Cluster, name: str, type_: str = "Ready") -> str | None:
    return cluster.condition(NS, name, type_).get("reason")


async def mark_ready(cluster: Cluster, name: str, ranks: int, routers: int = 1) -> None:
    """Play the StatefulSet and Deployment controllers: every pod up and ready."""
    await cluster.patch_status(
        STS,
        NS,
        name,
        {
            "replicas": ranks,
            "readyReplicas": ranks,
            "updatedReplicas": ranks,
            "currentRevision": "r1",
            "updateRevision": "r1",
        },
    )
    if routers:
        await cluster.patch_status(
            DEPLOY,
            NS,
            naming.router_name(name),
            {"replicas": routers, "readyReplicas": routers, "updatedReplicas": routers},
        )


def posted_events(cluster: Cluster, since: int = 0) -> list[dict[str, Any]]:
    return [
        r.data
        for r in cluster.requests(since)
        if r.method == "POST" and r.url.path.endswith("/events")
    ]


@contextlib.asynccontextmanager
async def running_operator(
    cluster: Cluster, *, observe_interval: float | None = None
) -> AsyncIterator[None]:
    """kopf.operator() in this event loop, cluster-wide, standalone; cancelled on exit."""
    ready = asyncio.Event()
    start = len(cluster.requests())
    task = asyncio.create_task(
        kopf.operator(
            clusterwide=True,
            standalone=True,
            ready_flag=ready,
            settings=kopf.OperatorSettings(),
            memo=kopf.Memo(
                kube=Kube.for_url(cluster.url),
                default_image="registry.test/berth:1",
                observe_interval=observe_interval,
            ),
        )
    )

    def watching() -> bool:
        if task.done():
            task.result()  # surface a crashed operator at once
        watched = {
            r.url.path.rsplit("/", 1)[-1]
            for r in cluster.requests(start)
            if r.params.get("watch") == "true"
        }
        return set(WATCHED) <= watched

    try:
        await eventually(watching, what="the operator's watches")
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
async def operator(cluster: Cluster) -> AsyncIterator[None]:
    async with running_operator(cluster):
        yield


Eventually = Callable[..., Awaitable[Any]]
