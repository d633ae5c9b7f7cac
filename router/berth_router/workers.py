"""The worker registry: which ranks exist, where they are, whether they are healthy, how loaded.

Ranks come from a static URL list or from discovery (`discovery.py`); either way each worker is
keyed by its DP rank. Active checks poll every rank's `/health` (and `/get_load` for load-aware
policies); the proxy reports what it sees on real requests, so a refused connection takes a rank
out of rotation at once, without waiting for the next check.

Why one module of ~400 lines: membership changes, active checks and what requests report all
write the same per-rank health and load, which stays consistent because one class makes every
change to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from berth_router.args import RouterArgs
from berth_router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

HealthStatus = Literal["unknown", "healthy", "unhealthy"]
# A rank's own /health says it will not serve for a while: out of rotation without a second look.
DEFINITIVE_PHASES = frozenset({"loading", "draining", "dead"})
_UNKNOWN_RANK = object()
# A rank may count a request a little after this router saw it end: a poll's answer counts as
# ours every request that ended this long before the poll was sent.
END_GRACE_S = 0.05
# How long ended requests are remembered for that (well over a poll's round trip).
ENDS_KEPT_S = 10.0


class HealthState:
    """Consecutive-count state machine of one worker's health.

    unknown --success--> healthy; unknown --failure--> unhealthy (a new worker must prove itself
    once); healthy --`failure_threshold` failures in a row, or one definitive failure-->
    unhealthy; unhealthy --`success_threshold` successes in a row--> healthy.
    """

    def __init__(self, failure_threshold: int = 2, success_threshold: int = 2) -> None:
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.status: HealthStatus = "unknown"
        self.reason = "not checked yet"
        self.failures = 0
        self.successes = 0

    @property
    def healthy(self) -> bool:
        return self.status == "healthy"

    def success(self) -> bool:
        """Record a good check; return True if the status changed."""
        self.failures = 0
        self.successes += 1
        if self.status == "healthy":
            return False
        if self.status == "unknown" or self.successes >= self.success_threshold:
            self.status, self.reason = "healthy", ""
            return True
        return False

    def failure(self, reason: str, *, definitive: bool = False) -> bool:
        """Record a failed check or request; return True if the status changed."""
        self.successes = 0
        self.failures += 1
        self.reason = reason
        if self.status == "unhealthy":
            return False
        if definitive or self.status == "unknown" or self.failures >= self.failure_threshold:
            self.status = "unhealthy"
            return True
        return False


@dataclass
class LoadSnapshot:
    requests: int  # in flight at the rank (being tokenized, waiting or running)
    running: int
    waiting: int
    token_usage: float
    received: float  # monotonic time it arrived
    # This router's requests that the rank may have counted: in flight when the answer arrived,
    # or ended while the poll was out (the rank counted them when it answered, this router no
    # longer does; not subtracting them made a phantom request that steered the next one away).
    own_requests: int
    # LoRA: the adapters the rank serves, and those in its device slots.
    adapters: frozenset[str] = frozenset()
    resident: frozenset[str] = frozenset()


@dataclass
class Worker:
    rank: int
    url: str | None  # None: the rank exists (its Service does) but has no endpoint
    health: HealthState
    endpoint_ready: bool = True  # discovery: the EndpointSlice marks the endpoint ready
    in_flight: int = 0
    load_snapshot: LoadSnapshot | None = None
    reported_rank: Any = _UNKNOWN_RANK  # what the rank itself says (--dp-rank), once asked
    served: int = 0
    ended: deque[float] = field(default_factory=deque, repr=False)  # monotonic end times
    check_task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def routable(self) -> bool:
        return self.url is not None and self.endpoint_ready and self.health.healthy

    @property
    def unavailable_reason(self) -> str:
        if self.url is None:
            return "it has no endpoint"
        if not self.endpoint_ready:
            return "its endpoint is not ready"
        return self.health.reason or self.health.status

    def ended_since(self, since: float) -> int:
        """This router's requests to the rank that ended at `since` or later."""
        count = 0
        for at in reversed(self.ended):
            if at < since:
                break
            count += 1
        return count

    def load(self, now: float, max_age: float) -> float:
        """This router's requests in flight there, plus what others sent it (from /get_load)."""
        snap = self.load_snapshot
        if snap is None or now - snap.received > max_age:
            return float(self.in_flight)
        return float(self.in_flight + max(0, snap.requests - snap.own_requests))

    def describe(self, now: float, max_age: float) -> dict[str, Any]:
        snap = self.load_snapshot
        return {
            "dp_rank": self.rank,
            "url": self.url,
            "routable": self.routable,
            "health": self.health.status,
            "reason": "" if self.routable else self.unavailable_reason,
            "endpoint_ready": self.endpoint_ready,
            "in_flight": self.in_flight,
            "load": self.load(now, max_age),
            "served": self.served,
            "rank_load": None
            if snap is None
            else {
                "requests": snap.requests,
                "running": snap.running,
                "waiting": snap.waiting,
                "token_usage": snap.token_usage,
                "lora_adapters": sorted(snap.adapters),
                "age_s": round(now - snap.received, 3),
            },
        }


@dataclass(frozen=True)
class Endpoint:
    """Where discovery found one rank."""

    url: str | None
    ready: bool


class WorkerRegistry:
    """All workers by rank, their active checks, and the load and health signals of requests."""

    def __init__(
        self,
        args: RouterArgs,
        metrics: RouterMetrics,
        *,
        poll_load: bool = True,
        on_rank_reset: Callable[[int], None] | None = None,
    ) -> None:
        self.args = args
        self.metrics = metrics
        self.poll_load = poll_load
        self.on_rank_reset = on_rank_reset or (lambda rank: None)
        self.workers: dict[int, Worker] = {}
        self.synced = asyncio.Event()  # the worker list is known (static, or first discovery)
        self.checked = asyncio.Event()  # every worker known at sync time was checked once
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(args.health_check_timeout),
            headers=headers,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self._tasks: list[asyncio.Task[None]] = []

    # --- membership ----------------------------------------------------------------------------

    def set_static(self, urls: tuple[str, ...]) -> None:
        self.update({rank: Endpoint(url, True) for rank, url in enumerate(urls)})

    def update(self, endpoints: Mapping[int, Endpoint]) -> None:
        """Make the worker set equal to `endpoints` (from the static list or from discovery)."""
        for rank in sorted(set(self.workers) - set(endpoints)):
            worker = self.workers.pop(rank)
            if worker.check_task is not None:
                worker.check_task.cancel()
            logger.info("Rank %d (%s) left", rank, worker.url)
            self.metrics.forget_rank(rank)
            self.on_rank_reset(rank)
        for rank, endpoint in sorted(endpoints.items()):
            worker = self.workers.get(rank)
            if worker is None:
                worker = Worker(
                    rank=rank,
                    url=endpoint.url,
                    health=self._new_health(),
                    endpoint_ready=endpoint.ready,
                )
                self.workers[rank] = worker
                logger.info("Rank %d joined at %s (ready: %s)", rank, endpoint.url, endpoint.ready)
            elif worker.url != endpoint.url:
                # A new pod (or none): a fresh process with an empty cache, unchecked.
                logger.info("Rank %d moved: %s -> %s", rank, worker.url, endpoint.url)
                if worker.check_task is not None:
                    worker.check_task.cancel()
                    worker.check_task = None
                worker.url = endpoint.url
                worker.health = self._new_health()
                worker.load_snapshot = None
                worker.reported_rank = _UNKNOWN_RANK
                self.on_rank_reset(rank)
            if worker.endpoint_ready != endpoint.ready:
                logger.info("Rank %d endpoint ready: %s", rank, endpoint.ready)
            worker.endpoint_ready = endpoint.ready
            self._publish(worker)
            if worker.url is not None and worker.health.status == "unknown":
                self.check_soon(worker)
        self.synced.set()

    def _new_health(self) -> HealthState:
        return HealthState(self.args.health_failure_threshold, self.args.health_success_threshold)

    def get(self, rank: int) -> Worker | None:
        return self.workers.get(rank)

    def ranks(self) -> list[int]:
        return sorted(self.workers)

    def routable(self) -> list[Worker]:
        return [self.workers[r] for r in sorted(self.workers) if self.workers[r].routable]

    def load_of(self, worker: Worker) -> float:
        return worker.load(time.monotonic(), self._load_max_age())

    def _load_max_age(self) -> float:
        return max(5 * self.args.load_poll_interval, 2.0)

    def describe(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [self.workers[r].describe(now, self._load_max_age()) for r in self.ranks()]

    # --- request bookkeeping (called by the proxy) ---------------------------------------------

    def begin(self, worker: Worker) -> None:
        worker.in_flight += 1
        worker.served += 1
        self.metrics.in_flight.labels(str(worker.rank)).set(worker.in_flight)

    def end(self, worker: Worker) -> None:
        worker.in_flight -= 1
        now = time.monotonic()
        worker.ended.append(now)
        while worker.ended[0] < now - ENDS_KEPT_S:
            worker.ended.popleft()
        if self.workers.get(worker.rank) is worker:
            self.metrics.in_flight.labels(str(worker.rank)).set(worker.in_flight)

    def report_connect_failure(self, worker: Worker, error: str) -> None:
        """Nothing listens there: out of rotation now; the checks bring it back."""
        self._failure(worker, f"connection failed: {error}", definitive=True)

    def report_suspect(self, worker: Worker) -> None:
        """A request saw a 503 or a dropped connection: check the rank now, not in seconds."""
        self.check_soon(worker)

    # --- active checks -------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._health_loop(), name="router-health"))
        if self.poll_load:
            self._tasks.append(asyncio.create_task(self._load_loop(), name="router-load"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for worker in self.workers.values():
            if worker.check_task is not None:
                worker.check_task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.client.aclose()

    async def initial_checks(self) -> None:
        """Wait for the worker list, then for one check of each worker (bounded)."""
        await self.synced.wait()
        pending = [w.check_task for w in self.workers.values() if w.check_task is not None]
        if pending:
            await asyncio.wait(pending, timeout=self.args.health_check_timeout + 1.0)
        self.checked.set()

    def check_soon(self, worker: Worker) -> None:
        """Check one worker now, unless a check of it is already running."""
        if worker.check_task is not None and not worker.check_task.done():
            return
        worker.check_task = asyncio.create_task(self.check(worker), name=f"check-{worker.rank}")

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.args.health_check_interval)
            for worker in list(self.workers.values()):
                if worker.url is not None:
                    self.check_soon(worker)

    async def check(self, worker: Worker) -> None:
        """One active health check: GET /health, and once per process its reported rank."""
        url = worker.url
        if url is None:
            return
        try:
            response = await self.client.get(f"{url}/health")
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            self._failure(worker, f"connection failed: {_describe(e)}", definitive=True, url=url)
            return
        except httpx.HTTPError as e:
            self._failure(worker, f"/health failed: {_describe(e)}", url=url)
            return
        if response.status_code != 200:
            status, reason = _health_body(response)
            self._failure(
                worker,
                f"/health {response.status_code} {status}: {reason}".rstrip(": "),
                definitive=status in DEFINITIVE_PHASES,
                url=url,
            )
            return
        if worker.reported_rank is _UNKNOWN_RANK:
            try:
                info = await self.client.get(f"{url}/get_server_info")
                info.raise_for_status()
                reported = info.json().get("dp_rank")
            except (httpx.HTTPError, ValueError, AttributeError) as e:
                self._failure(worker, f"/get_server_info failed: {_describe(e)}", url=url)
                return
            if worker.url != url:
                return
            worker.reported_rank = reported
        if worker.reported_rank is not None and worker.reported_rank != worker.rank:
            self._failure(
                worker,
                f"the server at {url} says it is rank {worker.reported_rank}, not {worker.rank}",
                definitive=True,
                url=url,
            )
            return
        if worker.url == url and worker.health.success():
            logger.info("Rank %d (%s) is healthy", worker.rank, url)
            self._publish(worker)

    def _failure(
        self, worker: Worker, reason: str, *, definitive: bool = False, url: str | None = None
    ) -> None:
        if url is not None and worker.url != url:
            return  # the rank moved while this check ran: its result is about the old pod
        if worker.health.failure(reason, definitive=definitive):
            logger.warning("Rank %d (%s) is out of rotation: %s", worker.rank, worker.url, reason)
            self._publish(worker)

    def _publish(self, worker: Worker) -> None:
        if self.workers.get(worker.rank) is worker:
            self.metrics.healthy.labels(str(worker.rank)).set(1 if worker.routable else 0)

    async def _load_loop(self) -> None:
        while True:
            workers = [w for w in self.workers.values() if w.url is not None and w.routable]
            await asyncio.gather(*(self._poll_load(w) for w in workers))
            await asyncio.sleep(self.args.load_poll_interval)

    async def _poll_load(self, worker: Worker) -> None:
        url = worker.url
        sent = time.monotonic()
        try:
            response = await self.client.get(f"{url}/get_load")
            response.raise_for_status()
            data = response.json()
            running = int(data.get("num_running_reqs") or 0)
            waiting = int(data.get("num_waiting_reqs") or 0)
            requests = int(data.get("num_inflight_requests") or 0)
            snapshot = LoadSnapshot(
                requests=max(requests, running + waiting),
                running=running,
                waiting=waiting,
                token_usage=float(data.get("token_usage") or 0.0),
                received=time.monotonic(),
                own_requests=worker.in_flight + worker.ended_since(sent - END_GRACE_S),
                adapters=frozenset(str(a) for a in data.get("lora_adapters") or ()),
                resident=frozenset(str(a) for a in data.get("lora_resident") or ()),
            )
        except (httpx.HTTPError, ValueError, TypeError, AttributeError) as e:
            logger.debug("Load poll of rank %d failed: %s", worker.rank, e)
            return
        if worker.url == url:
            worker.load_snapshot = snapshot


def _health_body(response: httpx.Response) -> tuple[str, str]:
    try:
        body = response.json()
    except ValueError:
        return "", response.text[:200]
    if not isinstance(body, dict):
        return "", str(body)[:200]
    return str(body.get("status", "")), str(body.get("reason", ""))[:200]


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
