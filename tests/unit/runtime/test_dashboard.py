"""The Grafana dashboard only plots metrics the runtime and the operator really export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from berth_runtime.metrics import MetricsCollector

DASHBOARD = Path(__file__).parents[3] / "manifests" / "dashboards" / "berth-grafana.json"


def exported_names() -> set[str]:
    collector = MetricsCollector("m", 0)
    # Series with free labels only appear once used.
    collector.http_requests.labels("/generate", "POST").inc()
    collector.http_responses.labels("/generate", "POST", "200").inc()
    text = collector.render().decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_panel_query_uses_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_names()
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"(?:sglang|berth):[a-z0-9_]+", target["expr"]))
    assert used, "no metrics found in the dashboard"
    assert used <= exported, used - exported


def test_operator_panels_use_the_operator_metrics():
    from berth_operator import metrics as operator_metrics

    operator_metrics.SCALE_EVENTS.labels("ns", "svc", "up")  # series appear once labelled
    for metric in operator_metrics.PER_SERVICE:
        metric.labels("ns", "svc")
    text = generate_latest(operator_metrics.REGISTRY).decode()
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    operator_metrics.forget("ns", "svc")
    dashboard = json.loads(DASHBOARD.read_text())
    used = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"berth_operator_[a-z0-9_]+", target["expr"])
    }
    assert {"berth_operator_desired_ranks", "berth_operator_stalls_total"} <= used
    assert used <= exported, used - exported


def test_panels_are_per_rank():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Running requests", "Queued requests", "KV cache token usage"} <= titles
    per_rank = [p for p in dashboard["panels"] if "dp_rank" in json.dumps(p["targets"])]
    assert len(per_rank) >= 10
