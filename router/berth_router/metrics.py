"""The router's Prometheus metrics: requests and errors per rank, retries, policy decisions."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

NO_RANK = "none"  # requests the router answered itself (no rank available, bad pin)

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


class RouterMetrics:
    """One registry per router, so that tests and several routers in one process never mix."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "berth:router_requests",
            "Requests answered, by the rank that served them (none = the router itself) and status",
            ["dp_rank", "endpoint", "status_code"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "berth:router_upstream_errors",
            "Failed attempts at a rank: connect (refused / timed out), disconnect (the rank "
            "dropped the connection before answering), status_503, stream_broken (after the "
            "first byte reached the client), timeout",
            ["dp_rank", "reason"],
            registry=r,
        )
        self.retries = Counter(
            "berth:router_retries",
            "Attempts repeated on another rank (connect failure, or 503 / disconnect before any "
            "byte reached the client)",
            ["endpoint"],
            registry=r,
        )
        self.lora_affinity = Counter(
            "berth:router_lora_affinity",
            "Requests for a LoRA adapter narrowed to the ranks that serve it: lora_resident (to "
            "those holding it in a device slot), lora_loaded (to those serving it)",
            ["decision"],
            registry=r,
        )
        self.decisions = Counter(
            "berth:router_policy_decisions",
            "How ranks were picked: prefix_hit, load_fallback_miss, load_fallback_imbalanced "
            "(cache_aware), least_load, round_robin, routing_key, pinned",
            ["policy", "decision"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "berth:router_client_disconnects",
            "Requests whose client went away; the upstream request was aborted",
            ["dp_rank"],
            registry=r,
        )
        self.in_flight = Gauge(
            "berth:router_in_flight_requests",
            "Requests this router has in flight at each rank",
            ["dp_rank"],
            registry=r,
        )
        self.healthy = Gauge(
            "berth:router_worker_healthy",
            "1 while the rank receives requests, 0 while it is out of rotation",
            ["dp_rank"],
            registry=r,
        )
        self.latency = Histogram(
            "berth:router_request_duration_seconds",
            "Router receipt -> last byte sent to the client",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def forget_rank(self, rank: int) -> None:
        """A rank left: drop its gauges (counters stay, as Prometheus expects)."""
        for gauge in (self.in_flight, self.healthy):
            try:
                gauge.remove(str(rank))
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
