"""Prometheus metrics of one server, with SGLang's names, gathered in the API process.

The scheduler reports its gauges in its heartbeat (`SchedulerStats`) and the TokenizerManager sees
every request's outputs, so one registry in the API process holds everything a scrape needs: no
multiprocess files, and the values are always from the same moment.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from berth_runtime.io_struct import SchedulerStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2, 5, 10, 20, 40, 80, 160, 400)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2, 4, 8)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320, 640, 1280, 2400)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)

# Tokens per KV cache page: the pool hands out one token slot at a time (mem_cache/kv_pool.py), so
# a page is one token and the cache holds max_total_num_tokens pages.
KV_PAGE_SIZE = 1

# Routes counted by name; anything else is "other" (bounded label cardinality).
KNOWN_ENDPOINTS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/generate",
        "/abort_request",
        "/flush_cache",
        "/health",
        "/health_generate",
        "/metrics",
        "/get_load",
        "/v1/loads",
        "/get_model_info",
        "/get_server_info",
    }
)


class MetricsCollector:
    """Every metric of this server; labelled with the served model name and the DP rank."""

    def __init__(self, model_name: str, dp_rank: int | None) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "dp_rank": str(dp_rank or 0)}
        names = list(labels)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(
                **labels
            )

        # Scheduler state (from the heartbeat).
        self.num_running_reqs = gauge("sglang:num_running_reqs", "Requests in the running batch")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "Requests waiting to be scheduled")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "KV cache tokens in use")
        self.max_total_num_tokens = gauge("sglang:max_total_num_tokens", "KV cache capacity")
        self.token_usage = gauge("sglang:token_usage", "Fraction of the KV cache in use")
        self.gen_throughput = gauge("sglang:gen_throughput", "Generated tokens/s (last second)")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "Prompt tokens served from cache")
        self.context_len = gauge("sglang:context_len", "Maximum tokens per request")
        # The KV cache's geometry as labels (value 1), as vLLM's vllm:cache_config_info: the
        # Gateway API Inference Extension's endpoint picker reads `page_size` and `num_pages`
        # from it for its prefix-cache scorer, instead of guessing them from its own config.
        self.cache_config_info = Gauge(
            "sglang:cache_config_info",
            "KV cache geometry in the labels: page_size (tokens per page), num_pages",
            [*names, "page_size", "num_pages"],
            registry=self.registry,
        )
        self._labels = labels
        self.heartbeat = gauge(
            "berth:scheduler_last_heartbeat_timestamp_seconds",
            "Unix time of the scheduler's last heartbeat (every 0.5 s while its loop runs)",
        )
        self.steps = gauge("berth:scheduler_steps", "Batches the scheduler has run since start")
        # Unlike sglang:generation_tokens (finished requests), this moves with every decode step:
        # a rank with work whose count stands still is stalled.
        self.scheduler_generated_tokens = gauge(
            "berth:scheduler_generated_tokens",
            "Output tokens the scheduler has generated since start, running requests included",
        )
        # Speculative decoding (--speculative-algorithm ngram), vLLM's counters as gauges of the
        # scheduler's running totals: accepted / draft is the acceptance rate.
        self.spec_draft_tokens = gauge(
            "berth:spec_decode_num_draft_tokens", "Draft tokens proposed for verification"
        )
        self.spec_accepted_tokens = gauge(
            "berth:spec_decode_num_accepted_tokens", "Draft tokens verification accepted"
        )

        # Per request (from the TokenizerManager).
        self.ttft = histogram(
            "sglang:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS
        )
        self.itl = histogram(
            "sglang:inter_token_latency_seconds", "Time between output tokens", ITL_BUCKETS
        )
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds",
            "Request latency, received to finished",
            E2E_BUCKETS,
        )
        self.queue_time = histogram(
            "sglang:queue_time_seconds", "Time waiting before first being scheduled", QUEUE_BUCKETS
        )
        self.prompt_tokens = counter("sglang:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter(
            "sglang:generation_tokens", "Generated tokens of finished requests"
        )
        self.cached_tokens = counter("sglang:cached_tokens", "Prompt tokens served from cache")
        self.num_requests = counter("sglang:num_requests", "Finished requests (aborted included)")
        self.num_aborted = counter("sglang:num_aborted_requests", "Aborted requests")

        # LoRA adapters (--enable-lora). The Inference Extension's endpoint picker reads
        # vllm:lora_requests_info for adapter affinity: its value is the time of the update, its
        # labels the most adapters a batch holds and, comma-separated, those in device slots
        # (ready to run) and those queued requests wait for.
        self.lora_requests = Counter(
            "sglang:lora_requests",
            "Finished requests per LoRA adapter (aborted included)",
            [*names, "lora_name"],
            registry=self.registry,
        )
        self.lora_requests_info = Gauge(
            "vllm:lora_requests_info",
            "LoRA adapters: max_lora, running_lora_adapters, waiting_lora_adapters",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=self.registry,
        )
        self.max_lora: int | None = None  # set by set_engine_info when LoRA is on

        # HTTP.
        self.http_requests = Counter(
            "sglang:http_requests",
            "HTTP requests received",
            ["endpoint", "method"],
            registry=self.registry,
        )
        self.http_responses = Counter(
            "sglang:http_responses",
            "HTTP responses sent",
            ["endpoint", "method", "status_code"],
            registry=self.registry,
        )

    def set_engine_info(
        self, context_len: int, max_total_num_tokens: int, max_lora: int | None = None
    ) -> None:
        """What the engine reported once ready; the cache's size is fixed from then on."""
        self.max_lora = max_lora or None
        self.context_len.set(context_len)
        self.max_total_num_tokens.set(max_total_num_tokens)
        # One label set only: a stale one left beside it would give a scraper two geometries.
        self.cache_config_info.clear()
        self.cache_config_info.labels(
            **self._labels,
            page_size=str(KV_PAGE_SIZE),
            num_pages=str(max_total_num_tokens // KV_PAGE_SIZE),
        ).set(1)

    def observe_stats(self, stats: SchedulerStats) -> None:
        self.num_running_reqs.set(stats.num_running_reqs)
        self.num_queue_reqs.set(stats.num_waiting_reqs)
        self.num_used_tokens.set(stats.num_used_tokens)
        self.max_total_num_tokens.set(stats.max_total_num_tokens)
        self.token_usage.set(stats.num_used_tokens / max(stats.max_total_num_tokens, 1))
        self.gen_throughput.set(stats.gen_throughput)
        self.cache_hit_rate.set(stats.cache_hit_rate)
        self.heartbeat.set(stats.time)
        self.steps.set(stats.step_count)
        self.scheduler_generated_tokens.set(stats.generated_tokens)
        self.spec_draft_tokens.set(stats.spec_draft_tokens)
        self.spec_accepted_tokens.set(stats.spec_accepted_tokens)
        if self.max_lora is not None:
            self.lora_requests_info.clear()  # one label set: the current one
            self.lora_requests_info.labels(
                max_lora=str(self.max_lora),
                running_lora_adapters=",".join(stats.lora_running),
                waiting_lora_adapters=",".join(stats.lora_waiting),
            ).set(stats.time)

    def observe_first_token(self, received_time: float, now: float) -> None:
        self.ttft.observe(max(now - received_time, 0.0))

    def observe_tokens(self, interval_s: float, num_tokens: int) -> None:
        """`num_tokens` arrived together after `interval_s`: each counts interval/num_tokens."""
        per_token = interval_s / num_tokens
        for _ in range(num_tokens):
            self.itl.observe(per_token)

    def observe_finished(
        self,
        *,
        received_time: float,
        tokenized_time: float,
        scheduled_time: float,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        aborted: bool,
        now: float | None = None,
        lora_name: str | None = None,
    ) -> None:
        now = time.time() if now is None else now
        if lora_name is not None:
            self.lora_requests.labels(**self._labels, lora_name=lora_name).inc()
        self.e2e.observe(max(now - received_time, 0.0))
        if scheduled_time and tokenized_time:
            self.queue_time.observe(max(scheduled_time - tokenized_time, 0.0))
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.num_requests.inc()
        if aborted:
            self.num_aborted.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class HttpMetricsMiddleware:
    """Pure ASGI: count requests and responses by endpoint, method and status code."""

    def __init__(self, app: Any, metrics: MetricsCollector) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in KNOWN_ENDPOINTS or path.startswith("/v1/models/") else "other"
        if endpoint.startswith("/v1/models/"):
            endpoint = "/v1/models/{model}"
        method = scope["method"]
        self.metrics.http_requests.labels(endpoint, method).inc()

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status = str(message["status"])
                self.metrics.http_responses.labels(endpoint, method, status).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
