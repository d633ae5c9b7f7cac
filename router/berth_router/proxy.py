"""Forward one request to a rank: pick it, retry until the first byte, stream back, abort on leave.

A request is committed to a rank only when the rank's first response byte is in hand: until then a
refused connection, a connection the rank dropped (it crashed) or a 503 (draining, queue full) is
retried on another rank, and the client never sees the failed attempt. From the first byte on,
chunks pass through as they arrive, never buffered. If the client goes away, the upstream
connection is closed at once, which the rank takes as an abort.

Why one module of ~400 lines: picking a rank, retrying before the first byte and streaming after
it are one exchange whose state (the attempt, its upstream response, the watch on the client)
passes from each step to the next; split up, that state would cross module boundaries.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from starlette.responses import Response

from berth_common.errors import RequestError, error_body
from berth_common.http import SSE_DONE, sse_event
from berth_router.args import RouterArgs
from berth_router.metrics import NO_RANK, RouterMetrics
from berth_router.policies import Candidate, Policy, rendezvous_order
from berth_router.signals import DP_RANK_HEADER, RouteSignals
from berth_router.workers import Worker, WorkerRegistry

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Never forwarded in either direction (RFC 9110 §7.6.1), plus what httpx / uvicorn set themselves.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
REQUEST_DROP = HOP_BY_HOP | {"host", "content-length"}
# x-request-id: the rank echoes the id the router gave it; the router's middleware sets it once.
RESPONSE_DROP = HOP_BY_HOP | {
    "date",
    "server",
    DP_RANK_HEADER.lower(),
    "x-berth-route",
    "x-request-id",
}
ROUTE_HEADER = "X-Berth-Route"
PINNED = "pinned"
ROUTING_KEY = "routing_key"
ANY = "any"  # requests without a prompt (/v1/models): the least busy rank, not the policy


class Router:
    """What every request shares: the registry, the policy, the metrics and the upstream pool."""

    def __init__(
        self,
        args: RouterArgs,
        registry: WorkerRegistry,
        policy: Policy,
        metrics: RouterMetrics,
    ) -> None:
        self.args = args
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=args.connect_timeout, read=args.request_timeout),
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=512, keepalive_expiry=30.0
            ),
        )
        self._any_turn = 0

    async def close(self) -> None:
        await self.client.aclose()

    def choose(self, signals: RouteSignals | None, tried: set[int]) -> tuple[Worker, str]:
        """The rank for the next attempt; RequestError (400 / 503) when there is none."""
        registry = self.registry
        if signals is None:
            return self._choose_any(tried), ANY
        if signals.pinned_rank is not None:
            rank = signals.pinned_rank
            worker = registry.get(rank)
            if worker is None:
                ranks = registry.ranks()
                known = f"0..{ranks[-1]}" if ranks == list(range(len(ranks))) and ranks else ranks
                raise RequestError(
                    f"there is no data-parallel rank {rank} (ranks: {known or 'none'})",
                    400,
                    param=signals.pinned_by,
                    code="rank_not_found",
                )
            if rank in tried or not worker.routable:
                reason = "it failed this request" if rank in tried else worker.unavailable_reason
                raise RequestError(
                    f"data-parallel rank {rank} is unavailable: {reason}",
                    503,
                    param=signals.pinned_by,
                    code="rank_unavailable",
                    headers={"Retry-After": "1"},
                )
            self._count(PINNED)
            return worker, PINNED
        candidates = [w for w in registry.routable() if w.rank not in tried]
        if not candidates:
            raise self._no_worker(tried)
        candidates, affinity = adapter_affinity(signals.model, candidates, registry.load_of)
        if affinity is not None:
            self.metrics.lora_affinity.labels(affinity).inc()
        by_rank = {w.rank: w for w in candidates}
        if signals.routing_key:
            # Over every known rank, so that a key keeps its rank while the set is unchanged;
            # if that rank is out of rotation, the key's next choice.
            for rank in rendezvous_order(signals.routing_key, registry.ranks()):
                if rank in by_rank:
                    self._count(ROUTING_KEY)
                    return by_rank[rank], ROUTING_KEY
        decision = self.policy.select(
            signals.text, [Candidate(w.rank, registry.load_of(w)) for w in candidates]
        )
        self._count(decision.decision)
        return by_rank[decision.rank], decision.decision

    def _choose_any(self, tried: set[int]) -> Worker:
        candidates = [w for w in self.registry.routable() if w.rank not in tried]
        if not candidates:
            raise self._no_worker(tried)
        low = min(w.in_flight for w in candidates)
        tied = [w for w in candidates if w.in_flight == low]
        self._any_turn += 1
        return tied[self._any_turn % len(tied)]

    def _no_worker(self, tried: set[int]) -> RequestError:
        known = len(self.registry.workers)
        detail = (
            "no rank is known yet"
            if not known
            else f"none of the {known} ranks is healthy"
            if not tried
            else f"every healthy rank failed it ({len(tried)} tried)"
        )
        return RequestError(
            f"no rank is available to serve the request: {detail}",
            503,
            code="no_available_workers",
            headers={"Retry-After": "1"},
        )

    def _count(self, decision: str) -> None:
        self.metrics.decisions.labels(self.policy.name, decision).inc()


# A rank that holds the adapter in a device slot is preferred while its load is at most this many
# requests above the least-loaded rank that serves the adapter (as the Inference Extension's LoRA
# affinity scorer prefers active adapters, within its queue threshold).
RESIDENT_SLACK = 4
ADAPTER_RESIDENT = "lora_resident"
ADAPTER_LOADED = "lora_loaded"


def adapter_affinity(
    model: str | None, candidates: list[Worker], load_of: Callable[[Worker], float]
) -> tuple[list[Worker], str | None]:
    """The candidates for a request naming `model`: when it names a LoRA adapter that some
    ranks serve (by their last /get_load), only those ranks (the others would answer 404), and
    among them the ranks holding it in a device slot, unless they are loaded RESIDENT_SLACK
    requests beyond the least-loaded one; the policy then picks among what is left. Returns the
    decision counted (None: no adapter involved)."""
    if model is None:
        return candidates, None
    name = model.rpartition(":")[2]

    def has(worker: Worker, attribute: str) -> bool:
        snap = worker.load_snapshot
        return snap is not None and name in getattr(snap, attribute)

    serving = [w for w in candidates if has(w, "adapters")]
    if not serving:
        return candidates, None
    resident = [w for w in serving if has(w, "resident")]
    if resident:
        low = min(load_of(w) for w in serving)
        if min(load_of(w) for w in resident) <= low + RESIDENT_SLACK:
            return resident, ADAPTER_RESIDENT
    return serving, ADAPTER_LOADED


@dataclass
class _Retry:
    """The attempt failed before the client saw anything; another rank may try."""

    reason: str
    response: tuple[int, list[tuple[bytes, bytes]], bytes] | None = None  # a 503 to fall back on


class ProxyResponse(Response):
    """An ASGI response that does the whole exchange with the ranks while watching the client."""

    def __init__(
        self,
        router: Router,
        *,
        method: str,
        path: str,
        query: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        signals: RouteSignals | None,
        endpoint: str,
    ) -> None:
        super().__init__()
        self.router = router
        self.method = method
        self.target = path + (f"?{query}" if query else "")
        self.upstream_headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in headers
            if k.decode("latin-1").lower() not in REQUEST_DROP
        ]
        self.body_bytes = body
        self.signals = signals
        self.endpoint = endpoint
        self.started = time.monotonic()
        self._finished = False
        self._rank: str = NO_RANK

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def watch_client() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        if not self._finished:
                            self.router.metrics.client_disconnects.labels(self._rank).inc()
                            logger.debug("Client left %s; aborting upstream", self.target)
                        group.cancel_scope.cancel()
                        return

            group.start_soon(watch_client)
            try:
                await self._exchange(send)
            finally:
                group.cancel_scope.cancel()

    async def _exchange(self, send: Send) -> None:
        router = self.router
        tried: set[int] = set()
        fallback: tuple[int, list[tuple[bytes, bytes]], bytes, Worker] | None = None
        attempts = 0
        while True:
            try:
                worker, decision = router.choose(self.signals, tried)
            except RequestError as err:
                if fallback is not None and err.status_code == 503:
                    status, headers, body, last = fallback
                    await self._send_whole(send, status, headers, body, last.rank)
                else:
                    await self._send_error(send, err)
                return
            tried.add(worker.rank)
            if attempts:
                router.metrics.retries.labels(self.endpoint).inc()
            attempts += 1
            pinned = self.signals is not None and self.signals.pinned_rank is not None
            may_retry = not pinned and attempts <= router.args.max_retries
            outcome = await self._attempt(worker, decision, send, retry_503=may_retry)
            if outcome is None:
                return
            if outcome.response is not None:
                fallback = (*outcome.response, worker)
            if not may_retry:
                if fallback is not None:
                    status, headers, body, last = fallback
                    await self._send_whole(send, status, headers, body, last.rank)
                    return
                err = RequestError(
                    f"data-parallel rank {worker.rank} failed the request: {outcome.reason}"
                    if pinned
                    else f"no rank could serve the request ({attempts} tried): {outcome.reason}",
                    503,
                    param=self.signals.pinned_by if pinned and self.signals else None,
                    code="rank_unavailable" if pinned else "no_available_workers",
                    headers={"Retry-After": "1"},
                )
                await self._send_error(send, err)
                return
            logger.info("Retrying %s on another rank: %s", self.target, outcome.reason)

    async def _attempt(
        self, worker: Worker, decision: str, send: Send, *, retry_503: bool
    ) -> _Retry | None:
        """One try at one rank; None when the response (good or bad) went to the client."""
        router, metrics = self.router, self.router.metrics
        rank = str(worker.rank)
        self._rank = rank
        router.registry.begin(worker)
        response: httpx.Response | None = None
        try:
            request = router.client.build_request(
                self.method,
                f"{worker.url}{self.target}",
                headers=self.upstream_headers,
                content=self.body_bytes,
            )
            try:
                response = await router.client.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                metrics.upstream_errors.labels(rank, "connect").inc()
                router.registry.report_connect_failure(worker, _describe(e))
                return _Retry(f"rank {rank}: connection failed ({_describe(e)})")
            except httpx.TimeoutException as e:
                metrics.upstream_errors.labels(rank, "timeout").inc()
                await self._send_error(send, _timeout_error(worker, e))
                return None
            except httpx.HTTPError as e:
                metrics.upstream_errors.labels(rank, "disconnect").inc()
                router.registry.report_suspect(worker)
                return _Retry(f"rank {rank} dropped the connection ({_describe(e)})")

            if response.status_code == 503 and retry_503:
                try:
                    body = await response.aread()
                except httpx.HTTPError:
                    body = b""
                metrics.upstream_errors.labels(rank, "status_503").inc()
                router.registry.report_suspect(worker)
                headers = self._response_headers(response, worker, decision)
                return _Retry(f"rank {rank} answered 503", (503, headers, body))

            chunks = response.aiter_raw()
            ended = False
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                first, ended = b"", True
            except httpx.TimeoutException as e:
                metrics.upstream_errors.labels(rank, "timeout").inc()
                await self._send_error(send, _timeout_error(worker, e))
                return None
            except httpx.HTTPError as e:
                metrics.upstream_errors.labels(rank, "disconnect").inc()
                router.registry.report_suspect(worker)
                return _Retry(f"rank {rank} dropped the connection ({_describe(e)})")

            # Committed: from here on the client sees this rank's answer.
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": self._response_headers(response, worker, decision),
                }
            )
            if first:
                await send({"type": "http.response.body", "body": first, "more_body": True})
            if not ended:
                try:
                    async for chunk in chunks:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except httpx.HTTPError as e:
                    metrics.upstream_errors.labels(rank, "stream_broken").inc()
                    router.registry.report_suspect(worker)
                    logger.warning("Rank %s broke a stream of %s: %s", rank, self.target, e)
                    if not _is_sse(response):
                        return None  # the client sees a short body (Content-Length) and a reset
                    err = error_body(
                        f"data-parallel rank {rank} failed while streaming: {_describe(e)}",
                        "InternalServerError",
                        502,
                    )
                    tail = (sse_event(err) + SSE_DONE).encode()
                    await send({"type": "http.response.body", "body": tail, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            self._finished = True
            metrics.requests.labels(rank, self.endpoint, str(response.status_code)).inc()
            metrics.latency.labels(self.endpoint).observe(time.monotonic() - self.started)
            return None
        finally:
            router.registry.end(worker)
            if response is not None:
                # Closing an unfinished response closes its connection: the rank aborts.
                with anyio.CancelScope(shield=True):
                    await response.aclose()

    def _response_headers(
        self, response: httpx.Response, worker: Worker, decision: str
    ) -> list[tuple[bytes, bytes]]:
        headers = [
            (k, v)
            for k, v in response.headers.raw
            if k.decode("latin-1").lower() not in RESPONSE_DROP
        ]
        headers.append((DP_RANK_HEADER.lower().encode(), str(worker.rank).encode()))
        headers.append((ROUTE_HEADER.lower().encode(), decision.encode()))
        return headers

    async def _send_whole(
        self, send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes, rank: int
    ) -> None:
        headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self._finished = True
        self.router.metrics.requests.labels(str(rank), self.endpoint, str(status)).inc()
        self.router.metrics.latency.labels(self.endpoint).observe(time.monotonic() - self.started)

    async def _send_error(self, send: Send, err: RequestError) -> None:
        body = json.dumps(err.body()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *((k.lower().encode(), v.encode()) for k, v in err.headers.items()),
        ]
        await send({"type": "http.response.start", "status": err.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self._finished = True
        self.router.metrics.requests.labels(NO_RANK, self.endpoint, str(err.status_code)).inc()
        self.router.metrics.latency.labels(self.endpoint).observe(time.monotonic() - self.started)


def _is_sse(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


def _timeout_error(worker: Worker, error: Exception) -> RequestError:
    return RequestError(
        f"data-parallel rank {worker.rank} did not answer in time ({_describe(error)})",
        504,
        err_type="GatewayTimeoutError",
        code="upstream_timeout",
    )


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
