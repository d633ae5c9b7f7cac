"""`/metrics` tells the truth: counters equal the traffic, gauges move under load and settle."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import metric, scrape, wait_for
from tests.integration.runtime.conftest import MODEL

REQUIRED = [
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "sglang:num_used_tokens",
    "sglang:max_total_num_tokens",
    "sglang:gen_throughput",
    "sglang:cache_hit_rate",
    "sglang:time_to_first_token_seconds_count",
    "sglang:inter_token_latency_seconds_count",
    "sglang:e2e_request_latency_seconds_count",
    "sglang:queue_time_seconds_count",
    "sglang:prompt_tokens_total",
    "sglang:generation_tokens_total",
    "sglang:cached_tokens_total",
    "sglang:num_requests_total",
    "sglang:num_aborted_requests_total",
]


def test_every_sglang_metric_is_exported_with_labels(server):
    samples = scrape(server.base_url)
    names = {name for name, _ in samples}
    for name in REQUIRED:
        assert name in names, name
    labels = dict(next(ls for (n, ls) in samples if n == "sglang:num_running_reqs"))
    assert labels == {"model_name": MODEL, "dp_rank": "0"}
    assert metric(samples, "sglang:max_total_num_tokens") > 0


def test_the_endpoint_picker_reads_its_sglang_series(http: httpx.Client):
    """What the Gateway API Inference Extension's endpoint picker reads from an SGLang-type
    server's `/metrics` (its model-server protocol, proposal 003): queue, running and KV cache
    utilization gauges, and the cache's geometry in the labels of `sglang:cache_config_info`."""
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    series = {}
    for name in (
        "sglang:num_queue_reqs",
        "sglang:num_running_reqs",
        "sglang:token_usage",
        "sglang:cache_config_info",
    ):
        assert name in families, name
        family = families[name]
        assert family.type == "gauge", (name, family.type)
        # One rank, one model: one sample, so the picker has no choice to make between them.
        assert len(family.samples) == 1, (name, family.samples)
        sample = family.samples[0]
        assert sample.name == name and sample.labels["model_name"] == MODEL, sample
        assert isinstance(sample.value, float) and math.isfinite(sample.value), sample
        series[name] = sample

    for name in ("sglang:num_queue_reqs", "sglang:num_running_reqs"):
        value = series[name].value
        assert value >= 0 and value == int(value), (name, value)
    assert 0 <= series["sglang:token_usage"].value <= 1

    info = series["sglang:cache_config_info"]
    assert info.value == 1
    # Whole numbers as the picker parses them (strconv.Atoi): no "1.0", no sign, no spaces.
    page_size, num_pages = info.labels["page_size"], info.labels["num_pages"]
    assert page_size.isdigit() and num_pages.isdigit(), info.labels
    assert int(page_size) >= 1 and int(num_pages) >= 1, info.labels
    engine = http.get("/get_server_info").json()["engine"]
    assert int(num_pages) * int(page_size) == engine["max_total_num_tokens"] > 0


def test_counters_equal_the_traffic(server, client: openai.OpenAI, http: httpx.Client):
    before = scrape(server.base_url)
    usages = []
    for prompt in ("Hello", "The sky is blue because", "List three fruits:"):
        resp = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        usages.append(resp.usage)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    usages.append(list(stream)[-1].usage)
    bad = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": 9})
    assert bad.status_code == 400
    after = scrape(server.base_url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("sglang:num_requests_total") == 4
    assert delta("sglang:num_aborted_requests_total") == 0
    assert delta("sglang:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("sglang:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("sglang:time_to_first_token_seconds_count") == 4
    assert delta("sglang:e2e_request_latency_seconds_count") == 4
    assert delta("sglang:queue_time_seconds_count") == 4
    # Every token after the first of each request is one inter-token observation.
    assert delta("sglang:inter_token_latency_seconds_count") == sum(
        u.completion_tokens - 1 for u in usages
    )
    completions = {"endpoint": "/v1/completions", "method": "POST"}
    assert delta("sglang:http_requests_total", **completions) == 4
    assert delta("sglang:http_responses_total", status_code="200", **completions) == 3
    assert delta("sglang:http_responses_total", status_code="400", **completions) == 1


def test_get_load_drops_a_finished_request_at_once(server):
    """A router places the next request by /get_load: a request that has just ended must not
    count as running there for the rest of the scheduler's half-second heartbeat (it once did,
    and sequential requests through the router then avoided the rank that had just served)."""
    for i in range(6):
        body = {"text": f"Request {i}:", "sampling_params": {"max_new_tokens": 64}}
        assert httpx.post(f"{server.base_url}/generate", json=body, timeout=60).status_code == 200

        def idle() -> dict:
            load = httpx.get(f"{server.base_url}/get_load", timeout=5).json()
            busy = load["num_running_reqs"], load["num_waiting_reqs"], load["num_inflight_requests"]
            return {} if any(busy) else load

        wait_for(idle, 0.1, interval=0.005, what=f"request {i} to leave /get_load")


def test_gauges_move_under_load_and_return_to_idle(server):
    # Distinct prompts: requests sharing a prefix would share its KV slots through the cache.
    names = ["Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot"]
    # Enough tokens that the requests run for several 0.2 s scrapes at 6 x 150 tokens/s.
    tokens = 160
    bodies = [
        {
            "text": f"{name} tells a long story.",
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
        }
        for name in names
    ]
    seen = {"running": 0.0, "used": 0.0, "usage": 0.0}
    generated_before = metric(scrape(server.base_url), "berth:scheduler_generated_tokens")

    def watch() -> bool:
        samples = scrape(server.base_url)
        seen["running"] = max(seen["running"], metric(samples, "sglang:num_running_reqs"))
        seen["used"] = max(seen["used"], metric(samples, "sglang:num_used_tokens"))
        seen["usage"] = max(seen["usage"], metric(samples, "sglang:token_usage"))
        return seen["running"] >= 4

    with ThreadPoolExecutor(6) as pool:
        futures = [
            pool.submit(httpx.post, f"{server.base_url}/generate", json=body, timeout=120)
            for body in bodies
        ]
        wait_for(watch, 60, interval=0.2, what="several running requests in the gauges")
        assert all(f.result().status_code == 200 for f in futures)
    # Each running request holds at least its own prompt tokens (4+) and what it decoded.
    assert seen["used"] >= 4 * 4 and 0 < seen["usage"] < 1
    wait_for(
        lambda: (
            metric(scrape(server.base_url), "sglang:num_running_reqs") == 0
            and metric(scrape(server.base_url), "sglang:num_used_tokens") == 0
        ),
        10,
        what="gauges back to idle",
    )
    assert metric(scrape(server.base_url), "sglang:num_queue_reqs") == 0
    # The scheduler's own count of every token it generated (what stall detection watches).
    # At least: `generated_before` came from a heartbeat that may predate the previous test's
    # last tokens.
    wait_for(
        lambda: (
            metric(scrape(server.base_url), "berth:scheduler_generated_tokens")
            >= generated_before + 6 * tokens
        ),
        10,
        what="the generated-token count in the heartbeat",
    )


def test_disconnect_counts_as_aborted(server, http: httpx.Client):
    before = metric(scrape(server.base_url), "sglang:num_aborted_requests_total")
    body = {
        "text": "Write an essay.",
        "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True},
    }
    try:
        httpx.post(f"{server.base_url}/generate", json=body, timeout=1.5)
    except httpx.ReadTimeout:
        pass
    wait_for(
        lambda: metric(scrape(server.base_url), "sglang:num_aborted_requests_total") == before + 1,
        10,
        what="the abort to be counted",
    )


def test_health_generate_runs_a_real_generation_and_is_not_counted(server, http: httpx.Client):
    before = metric(scrape(server.base_url), "sglang:num_requests_total")
    resp = http.get("/health_generate")
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}
    assert metric(scrape(server.base_url), "sglang:num_requests_total") == before


def test_metrics_and_load_need_no_auth_and_are_cheap(http: httpx.Client):
    load = http.get("/get_load").json()
    assert load["num_running_reqs"] >= 0 and "token_usage" in load
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")
