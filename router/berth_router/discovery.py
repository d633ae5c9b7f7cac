"""In-cluster discovery: follow the per-rank EndpointSlices and keep the worker registry in step.

The operator labels every per-rank Service with its rank (`serving.berth.dev/dp-rank`), and the
EndpointSlice controller copies a Service's labels onto its slices. So one list+watch of the
EndpointSlices matching a label selector yields, for every rank, the address of its pod and
whether that pod is ready: a rank that is not ready (loading, draining, failing its readiness
probe) leaves rotation as soon as its slice says so, a new rank joins when its Service appears,
and a removed rank leaves when its Service goes. No restart, no manual list.

The API client is `berth_common.kube`, the operator's too: plain httpx with the pod's
service-account token (read again for every request, as bound tokens rotate), so the router image
needs no Kubernetes client library.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from berth_common.kube import ApiError, ApiServer, NoApiServer, call, pod_namespace
from berth_router.workers import Endpoint

logger = logging.getLogger(__name__)

ENDPOINTSLICES = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
WATCH_TIMEOUT_S = 290
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0


class DiscoveryError(Exception):
    pass


def parse_selector(selector: str) -> list[tuple[str, str, str | None]]:
    """`a=b,c!=d,e,!f` -> [(key, op, value)] with op one of =, !=, exists, !exists.

    With `selector_matches`, what the API server does with a labelSelector; discovery itself
    leaves the selection to the API server (it sends the selector with its list and watch). The
    operator's tests use both to check that its --discover-selector picks its rank slices."""
    terms: list[tuple[str, str, str | None]] = []
    for raw in selector.split(","):
        term = raw.strip()
        if not term:
            continue
        if "!=" in term:
            key, value = term.split("!=", 1)
            terms.append((key.strip(), "!=", value.strip()))
        elif "=" in term:
            key, value = term.replace("==", "=", 1).split("=", 1)
            terms.append((key.strip(), "=", value.strip()))
        elif term.startswith("!"):
            terms.append((term[1:].strip(), "!exists", None))
        else:
            terms.append((term, "exists", None))
    return terms


def selector_matches(terms: list[tuple[str, str, str | None]], labels: Mapping[str, str]) -> bool:
    for key, op, value in terms:
        present = key in labels
        if op == "=" and labels.get(key) != value:
            return False
        if op == "!=" and present and labels.get(key) == value:
            return False
        if op == "exists" and not present:
            return False
        if op == "!exists" and present:
            return False
    return True


def endpoints_from_slices(
    slices: Mapping[str, Mapping[str, Any]], rank_label: str, port_name: str
) -> dict[int, Endpoint]:
    """Per rank, the URL of its ready endpoint (or of a not-ready one, or none) from its slices."""
    found: dict[int, list[tuple[bool, str]]] = {}
    for slice_ in slices.values():
        labels = (slice_.get("metadata") or {}).get("labels") or {}
        try:
            rank = int(labels[rank_label])
        except (KeyError, ValueError, TypeError):
            continue
        if rank < 0:
            continue
        candidates = found.setdefault(rank, [])
        port = _slice_port(slice_, port_name)
        if port is None:
            continue
        for endpoint in slice_.get("endpoints") or []:
            addresses = endpoint.get("addresses") or []
            if not addresses:
                continue
            # "ready" absent means unknown, which consumers must treat as ready.
            ready = (endpoint.get("conditions") or {}).get("ready") is not False
            host = addresses[0]
            host = f"[{host}]" if ":" in host else host
            candidates.append((ready, f"http://{host}:{port}"))
    result = {}
    for rank, candidates in found.items():
        candidates.sort(key=lambda c: (not c[0], c[1]))  # ready first, then stable by address
        result[rank] = (
            Endpoint(candidates[0][1], candidates[0][0]) if candidates else Endpoint(None, False)
        )
    return result


def _slice_port(slice_: Mapping[str, Any], port_name: str) -> int | None:
    ports = [p for p in slice_.get("ports") or [] if p.get("port")]
    for port in ports:
        if port.get("name") == port_name:
            return int(port["port"])
    return int(ports[0]["port"]) if ports else None


@dataclass(frozen=True)
class KubeConfig:
    """Which API server to ask, and for which namespace's EndpointSlices."""

    server: ApiServer
    namespace: str

    @classmethod
    def from_environment(cls, api_url: str | None, namespace: str | None) -> KubeConfig:
        """The pod's API server and namespace, unless the flags name others."""
        namespace = namespace or pod_namespace()
        if namespace is None:
            raise DiscoveryError(
                "--discover-namespace is required outside a pod (no service-account namespace)"
            )
        try:
            server = ApiServer.in_cluster(api_url)
        except NoApiServer:
            raise DiscoveryError(
                "--kube-api-url is required outside a cluster ($KUBERNETES_SERVICE_HOST unset)"
            ) from None
        return cls(server, namespace)


class EndpointSliceDiscovery:
    """List + watch the EndpointSlices of the per-rank Services; report per-rank endpoints."""

    def __init__(
        self,
        kube: KubeConfig,
        selector: str,
        rank_label: str,
        port_name: str,
        on_change: Callable[[dict[int, Endpoint]], None],
    ) -> None:
        self.kube = kube
        self.selector = selector
        self.rank_label = rank_label
        self.port_name = port_name
        self.on_change = on_change
        self.slices: dict[str, dict[str, Any]] = {}
        self._last: dict[int, Endpoint] | None = None
        self.client = kube.server.client(httpx.Timeout(10.0, read=WATCH_TIMEOUT_S + 30))
        self.path = ENDPOINTSLICES.format(namespace=kube.namespace)

    async def run(self) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            try:
                version = await self._list()
                backoff = BACKOFF_MIN_S
                while True:
                    version = await self._watch(version)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the API server restarts, a network blip, a bad token
                if isinstance(e, ApiError) and e.expired:
                    logger.info("EndpointSlice watch expired; listing again")
                    continue
                logger.warning(
                    "EndpointSlice discovery failed (%s: %s); retrying in %.1fs",
                    type(e).__name__,
                    e,
                    backoff,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def close(self) -> None:
        await self.client.aclose()

    async def _list(self) -> str | None:
        body = await call(self.client, "GET", self.path, query={"labelSelector": self.selector})
        self.slices = {}
        for item in body.get("items") or []:
            self._store("ADDED", item)
        self._publish()
        return (body.get("metadata") or {}).get("resourceVersion")

    async def _watch(self, version: str | None) -> str | None:
        """Follow one watch request until the server ends it; return the last resourceVersion."""
        params = {
            "labelSelector": self.selector,
            "watch": "true",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S),
        }
        if version:
            params["resourceVersion"] = version
        async with self.client.stream("GET", self.path, params=params) as response:
            if not response.is_success:
                raise ApiError.from_response(
                    response.status_code, response.reason_phrase, await response.aread()
                )
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind = event.get("type")
                obj = event.get("object") or {}
                if kind == "ERROR":  # a Status object: 410 when the watch's version is too old
                    raise ApiError(
                        int(obj.get("code") or 0), obj.get("reason") or "", obj.get("message", "")
                    )
                new_version = (obj.get("metadata") or {}).get("resourceVersion")
                if new_version:
                    version = new_version
                if kind == "BOOKMARK":
                    continue
                self._store(kind, obj)
                self._publish()
        return version

    def _store(self, kind: str | None, obj: dict[str, Any]) -> None:
        """Keep the slice, or forget it. The API server sends only the slices that match the
        selector; one whose labels stop matching comes as DELETED."""
        name = (obj.get("metadata") or {}).get("name")
        if not name:
            return
        if kind == "DELETED":
            self.slices.pop(name, None)
        else:
            self.slices[name] = obj

    def _publish(self) -> None:
        endpoints = endpoints_from_slices(self.slices, self.rank_label, self.port_name)
        if endpoints != self._last:
            self._last = endpoints
            self.on_change(endpoints)
