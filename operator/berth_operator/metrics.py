"""The operator's own Prometheus metrics: what it decided (ranks, scaling, stalls, imbalance).

Served by `berth operator run --metrics-port`. Every series is labelled with the
InferenceService's namespace and name, and removed when the InferenceService goes away.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from berth_operator.status import Live

REGISTRY = CollectorRegistry()
LABELS = ("namespace", "name")

DESIRED_RANKS = Gauge(
    "berth_operator_desired_ranks",
    "Ranks that should serve (spec.replicas, or the autoscaler's decision)",
    LABELS,
    registry=REGISTRY,
)
SERVING_RANKS = Gauge(
    "berth_operator_serving_ranks",
    "Ranks that are ready, answer their metrics and are not stalled or draining",
    LABELS,
    registry=REGISTRY,
)
QUEUED_REQUESTS = Gauge(
    "berth_operator_queued_requests",
    "Requests waiting across all ranks, at the last scrape",
    LABELS,
    registry=REGISTRY,
)
STALLED_RANKS = Gauge(
    "berth_operator_stalled_ranks",
    "Ranks withdrawn from routing as stalled: the scheduler stopped, or restarted and not ready",
    LABELS,
    registry=REGISTRY,
)
RANK_IMBALANCE = Gauge(
    "berth_operator_rank_imbalance",
    "1 while one rank's queue stays far above the others' (condition reason RankImbalance)",
    LABELS,
    registry=REGISTRY,
)
SCALE_EVENTS = Counter(
    "berth_operator_scale_events",
    "Autoscaler decisions that changed the rank count, by direction (up or down)",
    (*LABELS, "direction"),
    registry=REGISTRY,
)
STALLS = Counter(
    "berth_operator_stalls",
    "Times a rank was found stalled",
    LABELS,
    registry=REGISTRY,
)
RANK_RESTARTS = Counter(
    "berth_operator_rank_restarts",
    "Stalled ranks whose pod the operator deleted so that it is recreated",
    LABELS,
    registry=REGISTRY,
)
SCRAPE_ERRORS = Counter(
    "berth_operator_scrape_errors",
    "Rank metrics scrapes that failed (timeout, refused, bad answer)",
    LABELS,
    registry=REGISTRY,
)
PER_SERVICE = (
    DESIRED_RANKS,
    SERVING_RANKS,
    QUEUED_REQUESTS,
    STALLED_RANKS,
    RANK_IMBALANCE,
    STALLS,
    RANK_RESTARTS,
    SCRAPE_ERRORS,
)


def record_live(namespace: str, name: str, live: Live) -> None:
    DESIRED_RANKS.labels(namespace, name).set(live.desired)
    serving = sum(1 for rank in live.ranks if rank.get("state") == "Serving")
    SERVING_RANKS.labels(namespace, name).set(serving)
    QUEUED_REQUESTS.labels(namespace, name).set(live.queued)
    STALLED_RANKS.labels(namespace, name).set(len(live.stalled))
    RANK_IMBALANCE.labels(namespace, name).set(1 if live.imbalance else 0)


def forget(namespace: str, name: str) -> None:
    """Drop the series of an InferenceService that no longer exists."""
    for metric in PER_SERVICE:
        try:
            metric.remove(namespace, name)
        except KeyError:
            pass
    for direction in ("up", "down"):
        try:
            SCALE_EVENTS.remove(namespace, name, direction)
        except KeyError:
            pass


def serve(port: int, address: str = "0.0.0.0") -> None:
    """Expose REGISTRY at http://address:port/metrics (a background thread)."""
    start_http_server(port, addr=address, registry=REGISTRY)
