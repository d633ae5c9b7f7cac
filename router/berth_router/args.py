"""RouterArgs: every knob of `berth router`, with its default, validation and CLI flag."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from berth_common.auth import Keys, settle_keys
from berth_common.dataclass_cli import DataclassCli

DEFAULT_ROUTER_PORT = 30080
DEFAULT_RANK_LABEL = "serving.berth.dev/dp-rank"
POLICIES = ("cache_aware", "least_load", "round_robin")


@dataclass(frozen=True, kw_only=True)
class RouterArgs(DataclassCli):
    """The router's configuration; the operator renders exactly these flags."""

    # HTTP
    host: str = field(default="127.0.0.1", metadata={"help": "Address to listen on."})
    port: int = field(default=DEFAULT_ROUTER_PORT, metadata={"help": "Port to listen on."})
    api_key: str | None = field(
        default=None,
        metadata={
            "help": "Require `Authorization: Bearer <key>` on every endpoint but /health, "
            "/liveness, /readiness and /metrics, and send it to the ranks' own endpoints "
            "(default: $BERTH_API_KEY if set)."
        },
    )
    api_key_file: str | None = field(
        default=None,
        metadata={"help": "Read --api-key from this file (a mounted Secret), once at start."},
    )
    admin_api_key: str | None = field(
        default=None,
        metadata={
            "help": "The key for admin routes (/flush_cache, /abort_request with abort_all), "
            "passed on to the ranks; the serving key cannot call them "
            "(default: $BERTH_ADMIN_API_KEY if set)."
        },
    )
    admin_api_key_file: str | None = field(
        default=None,
        metadata={"help": "Read --admin-api-key from this file, once at start."},
    )
    graceful_shutdown_timeout: float = field(
        default=30.0,
        metadata={"help": "Seconds to let in-flight (streaming) requests finish after SIGTERM."},
    )
    max_request_body_mb: float = field(
        default=16.0,
        metadata={
            "help": "Largest request body passed on, in MiB; larger ones get 413 before they are "
            "read (each rank has its own limit too)."
        },
    )

    # Workers
    worker_urls: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "Static rank URLs; the i-th URL is rank i (a rank that reports another "
            "--dp-rank is kept out of rotation). Not with --discover-selector.",
            "nargs": "*",
        },
    )
    discover_selector: str | None = field(
        default=None,
        metadata={
            "help": "Discover the ranks in-cluster: watch the EndpointSlices matching this label "
            "selector (e.g. `serving.berth.dev/inferenceservice=chat,serving.berth.dev/dp-rank`); "
            "each slice's rank label gives the rank, its ready endpoint the address."
        },
    )
    discover_namespace: str | None = field(
        default=None,
        metadata={"help": "Namespace to discover in (default: the router pod's own namespace)."},
    )
    discover_rank_label: str = field(
        default=DEFAULT_RANK_LABEL,
        metadata={"help": "EndpointSlice label that holds the DP rank."},
    )
    discover_port_name: str = field(
        default="http",
        metadata={"help": "EndpointSlice port to use (by name; the first port if none matches)."},
    )
    kube_api_url: str | None = field(
        default=None,
        metadata={
            "help": "Kubernetes API URL for discovery (default: in-cluster, from "
            "$KUBERNETES_SERVICE_HOST with the pod's service-account token and CA)."
        },
    )

    # Policy
    policy: Literal["cache_aware", "least_load", "round_robin"] = field(
        default="cache_aware", metadata={"help": "How a request that is not pinned picks a rank."}
    )
    cache_threshold: float = field(
        default=0.3,
        metadata={
            "help": "cache_aware: follow the rank holding the longest matching prefix when it "
            "covers more than this fraction of the prompt, else take the least-loaded rank."
        },
    )
    balance_abs_threshold: int = field(
        default=32,
        metadata={
            "help": "cache_aware: loads are imbalanced (route to the least-loaded rank) when "
            "max - min exceeds this many requests ..."
        },
    )
    balance_rel_threshold: float = field(
        default=1.5,
        metadata={"help": "cache_aware: ... and max exceeds min times this factor."},
    )
    max_tree_chars: int = field(
        default=4_000_000,
        metadata={
            "help": "cache_aware: prompt characters remembered per rank; the least recently "
            "used are forgotten first."
        },
    )

    # Health, load and retries
    health_check_interval: float = field(
        default=2.0, metadata={"help": "Seconds between active /health checks of every rank."}
    )
    health_check_timeout: float = field(
        default=2.0, metadata={"help": "Timeout of one health check in seconds."}
    )
    health_failure_threshold: int = field(
        default=2,
        metadata={
            "help": "Consecutive failed checks that take a healthy rank out of rotation (a refused "
            "connection or a draining / dead /health takes it out at once)."
        },
    )
    health_success_threshold: int = field(
        default=2,
        metadata={"help": "Consecutive good checks that bring an unhealthy rank back."},
    )
    load_poll_interval: float = field(
        default=0.5,
        metadata={"help": "Seconds between /get_load polls of every rank (load-aware policies)."},
    )
    max_retries: int = field(
        default=2,
        metadata={
            "help": "Extra attempts on other ranks when a rank refuses the connection, fails "
            "before answering, or answers 503 before any byte reached the client."
        },
    )
    connect_timeout: float = field(
        default=3.0, metadata={"help": "Seconds to connect to a rank before trying another."}
    )
    request_timeout: float | None = field(
        default=None,
        metadata={"help": "Seconds a rank may take between two bytes (default: no limit)."},
    )

    log_level: Literal["debug", "info", "warning", "error"] = field(
        default="info", metadata={"help": "Log level."}
    )

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.worker_urls and self.discover_selector:
            raise ValueError("give either --worker-urls or --discover-selector, not both")
        for url in self.worker_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--worker-urls: {url!r} is not an http(s) URL")
        object.__setattr__(self, "worker_urls", tuple(u.rstrip("/") for u in self.worker_urls))
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("--cache-threshold must be within [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("--balance-abs-threshold >= 0 and --balance-rel-threshold >= 1")
        for name in (
            "max_tree_chars",
            "health_check_interval",
            "health_check_timeout",
            "health_failure_threshold",
            "health_success_threshold",
            "load_poll_interval",
            "connect_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError("--request-timeout must be positive")
        if self.max_retries < 0:
            raise ValueError("--max-retries must be >= 0")
        if self.graceful_shutdown_timeout < 0:
            raise ValueError("--graceful-shutdown-timeout must be >= 0")
        if self.max_request_body_mb <= 0:
            raise ValueError("--max-request-body-mb must be positive")
        settle_keys(self)

    @property
    def keys(self) -> Keys:
        return Keys(self.api_key, self.admin_api_key)

    @property
    def discovery(self) -> bool:
        return self.discover_selector is not None
