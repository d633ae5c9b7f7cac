"""In-cluster discovery: follow the per-rank EndpointSlices and keep the worker registry in step.

The operator labels every per-rank Service with its rank (`serving.berth.dev/dp-rank`), and the
EndpointSlice controller copies a Service's labels onto its slices. So one list+watch of the
EndpointSlices matching a label selector yields, for every rank, the address of its pod and
whether that pod is ready: a rank that is not ready (loading, draining, failing its readiness
probe) leaves rotation as soon as its slice says so, a new rank joins when its Service appears,
and a removed rank leaves when its Service goes. No restart, no manual list.

Plain httpx against the API server with the pod's service-account token (re-read on every
reconnect, as bound tokens rotate), so the runtime image needs no Kubernetes client library.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from berth_router.workers import Endpoint

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
ENDPOINTSLICES = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
WATCH_TIMEOUT_S = 290
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0


class DiscoveryError(Exception):
    pass


class _Expired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


def parse_selector(selector: str) -> list[tuple[str, str, str | None]]:
    """`a=b,c!=d,e,!f` -> [(key, op, value)] with op one of =, !=, exists, !exists."""
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


class KubeConfig:
    """Where the API server is and how to authenticate to it."""

    def __init__(
        self,
        api_url: str,
        namespace: str,
        token_path: Path | None = None,
        ca_path: Path | None = None,
    ) -> None:
        self.api_url = api_url.rstrip("/")
        self.namespace = namespace
        self.token_path = token_path
        self.ca_path = ca_path

    @classmethod
    def from_environment(cls, api_url: str | None, namespace: str | None) -> KubeConfig:
        sa = SERVICE_ACCOUNT_DIR
        if namespace is None:
            try:
                namespace = (sa / "namespace").read_text().strip()
            except OSError:
                raise DiscoveryError(
                    "--discover-namespace is required outside a pod (no service-account namespace)"
                ) from None
        if api_url is None:
            host = os.environ.get("KUBERNETES_SERVICE_HOST")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if host:
                host = f"[{host}]" if ":" in host else host
                api_url = f"https://{host}:{port}"
            elif (sa / "token").exists():
                api_url = "https://kubernetes.default.svc"
            else:
                raise DiscoveryError(
                    "--kube-api-url is required outside a cluster ($KUBERNETES_SERVICE_HOST unset)"
                )
        token = sa / "token"
        ca = sa / "ca.crt"
        return cls(
            api_url,
            namespace,
            token_path=token if token.exists() else None,
            ca_path=ca if ca.exists() and api_url.startswith("https") else None,
        )

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.token_path is not None:
            headers["Authorization"] = f"Bearer {self.token_path.read_text().strip()}"
        return headers


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
        self.terms = parse_selector(selector)
        self.rank_label = rank_label
        self.port_name = port_name
        self.on_change = on_change
        self.slices: dict[str, dict[str, Any]] = {}
        self._last: dict[int, Endpoint] | None = None
        verify: Any = (
            ssl.create_default_context(cafile=str(kube.ca_path))
            if kube.ca_path is not None
            else True
        )
        self.client = httpx.AsyncClient(
            base_url=kube.api_url,
            verify=verify,
            timeout=httpx.Timeout(10.0, read=WATCH_TIMEOUT_S + 30),
        )
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
            except _Expired:
                logger.info("EndpointSlice watch expired; listing again")
            except Exception as e:  # the API server restarts, a network blip, a bad token
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
        response = await self.client.get(
            self.path, params={"labelSelector": self.selector}, headers=self.kube.headers()
        )
        if response.status_code != 200:
            raise DiscoveryError(f"listing EndpointSlices: {response.status_code} {response.text}")
        body = response.json()
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
        async with self.client.stream(
            "GET", self.path, params=params, headers=self.kube.headers()
        ) as response:
            if response.status_code == 410:
                raise _Expired()
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                raise DiscoveryError(f"watching EndpointSlices: {response.status_code} {body}")
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind = event.get("type")
                obj = event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Expired()
                    raise DiscoveryError(f"watch error: {obj.get('message') or obj}")
                new_version = (obj.get("metadata") or {}).get("resourceVersion")
                if new_version:
                    version = new_version
                if kind == "BOOKMARK":
                    continue
                self._store(kind, obj)
                self._publish()
        return version

    def _store(self, kind: str | None, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        name = meta.get("name")
        if not name:
            return
        if kind == "DELETED" or not selector_matches(self.terms, meta.get("labels") or {}):
            self.slices.pop(name, None)
        else:
            self.slices[name] = obj

    def _publish(self) -> None:
        endpoints = endpoints_from_slices(self.slices, self.rank_label, self.port_name)
        if endpoints != self._last:
            self._last = endpoints
            self.on_change(endpoints)
