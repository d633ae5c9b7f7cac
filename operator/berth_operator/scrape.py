"""Scrape each rank's `/metrics` and `/get_load`: find the rank pods and their addresses.

The operator talks to the rank pods directly (pod IP and the container's `http` port), not through
the per-rank Services: a rank withdrawn from routing (its Service removed) must still be watched.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from berth_operator import constants as c

SCRAPE_TIMEOUT_SECONDS = 2.0

# The runtime's metric names (SGLang's where SGLang has one) -> RankSample fields.
METRICS = {
    "sglang:num_queue_reqs": "queued",
    "sglang:num_running_reqs": "running",
    "sglang:token_usage": "token_usage",
    "sglang:gen_throughput": "gen_throughput",
    "berth:scheduler_generated_tokens": "generated_tokens",
    "berth:scheduler_steps": "steps",
    "berth:scheduler_last_heartbeat_timestamp_seconds": "heartbeat",
}


@dataclass(frozen=True)
class RankTarget:
    """One rank pod to scrape."""

    rank: int
    pod: str
    uid: str
    url: str  # http://<pod IP>:<port>, no trailing slash
    ready: bool


@dataclass(frozen=True)
class RankSample:
    """What one scrape of one rank found (`ok` False: it did not answer, `error` says why)."""

    rank: int
    pod: str
    uid: str
    time: float
    ready: bool
    ok: bool
    error: str | None = None
    queued: int = 0
    running: int = 0
    token_usage: float = 0.0
    gen_throughput: float = 0.0
    generated_tokens: float = 0.0
    steps: float = 0.0
    heartbeat: float = 0.0
    # From /get_load: requests the API process holds (being tokenized, generated or streamed out),
    # and the server's phase (loading, ready, ...).
    inflight: int = 0
    phase: str = ""

    @property
    def busy(self) -> bool:
        """The scheduler has work (what a stalled scheduler leaves undone)."""
        return self.queued + self.running > 0

    @property
    def serving(self) -> bool:
        """The pod is ready and answers: it takes requests through its Service."""
        return self.ok and self.ready

    @property
    def idle(self) -> bool:
        """Nothing left to finish anywhere in the server: safe to remove the rank."""
        return not self.busy and self.inflight == 0


def rank_targets(pods: Iterable[Mapping[str, Any]]) -> list[RankTarget]:
    """The rank pods that have an address, by rank; terminating pods are left out."""
    targets = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        if meta.get("deletionTimestamp") or not status.get("podIP"):
            continue
        rank = pod_rank(meta)
        if rank is None:
            continue
        host = status["podIP"]
        host = f"[{host}]" if ":" in host else host
        targets.append(
            RankTarget(
                rank=rank,
                pod=meta.get("name", ""),
                uid=meta.get("uid", ""),
                url=f"http://{host}:{_http_port(pod)}",
                ready=_pod_ready(status),
            )
        )
    return sorted(targets, key=lambda t: t.rank)


def pod_rank(meta: Mapping[str, Any]) -> int | None:
    """The DP rank of a StatefulSet pod: its ordinal (label, or the name's numeric suffix)."""
    index = (meta.get("labels") or {}).get(c.POD_INDEX_LABEL)
    if index is None:
        index = meta.get("name", "").rpartition("-")[2]
    try:
        return int(index)
    except ValueError:
        return None


def _http_port(pod: Mapping[str, Any]) -> int:
    for container in (pod.get("spec") or {}).get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == "http" and port.get("containerPort"):
                return int(port["containerPort"])
    return c.HTTP_PORT


def _pod_ready(status: Mapping[str, Any]) -> bool:
    return any(
        cond.get("type") == "Ready" and cond.get("status") == "True"
        for cond in status.get("conditions") or ()
    )


def parse_metrics(text: str) -> dict[str, float]:
    """The values of the metrics in METRICS, summed over label sets (one rank: one set).

    NaN counts as no value. ValueError for text that is not the Prometheus format, or an
    infinite value (a rank that reports an infinite queue cannot be reasoned about).
    """
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = METRICS.get(sample.name)
            if field is None or math.isnan(sample.value):
                continue  # NaN: no value yet
            if math.isinf(sample.value):
                raise ValueError(f"{sample.name} is {sample.value}, not a finite number")
            values[field] = values.get(field, 0.0) + sample.value
    return values


async def scrape(client: httpx.AsyncClient, target: RankTarget, now: float) -> RankSample:
    """One rank's sample from both endpoints (asked at once); a rank that does not answer both
    in time gives `ok=False`, never an error."""
    base = {
        "rank": target.rank,
        "pod": target.pod,
        "uid": target.uid,
        "time": now,
        "ready": target.ready,
    }
    try:
        metrics, load = await asyncio.gather(
            client.get(f"{target.url}{c.METRICS_PATH}", timeout=SCRAPE_TIMEOUT_SECONDS),
            client.get(f"{target.url}{c.LOAD_PATH}", timeout=SCRAPE_TIMEOUT_SECONDS),
        )
        metrics.raise_for_status()
        load.raise_for_status()
        values = parse_metrics(metrics.text)
        load_info = load.json()
        inflight = int(load_info.get("num_inflight_requests") or 0)
        phase = str(load_info.get("phase") or "")
    except (httpx.HTTPError, ValueError, TypeError, AttributeError) as e:
        return RankSample(**base, ok=False, error=f"{type(e).__name__}: {e}".rstrip(": "))
    return RankSample(
        **base,
        ok=True,
        queued=int(values.get("queued", 0)),
        running=int(values.get("running", 0)),
        token_usage=values.get("token_usage", 0.0),
        gen_throughput=values.get("gen_throughput", 0.0),
        generated_tokens=values.get("generated_tokens", 0.0),
        steps=values.get("steps", 0.0),
        heartbeat=values.get("heartbeat", 0.0),
        inflight=inflight,
        phase=phase,
    )


async def scrape_all(
    client: httpx.AsyncClient, targets: Sequence[RankTarget], now: float
) -> list[RankSample]:
    """Every rank at once (neither endpoint needs the API key): one slow rank costs the tick its
    timeout, not the sum of them."""
    return list(await asyncio.gather(*(scrape(client, t, now) for t in targets)))
