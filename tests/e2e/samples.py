"""The InferenceServices the e2e tests apply: the shipped CPU sample, sized for a two-CPU node, and
what they read back from a rank (its Prometheus metrics)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.e2e.cluster import Cluster

SAMPLE = (
    Path(__file__).resolve().parents[2]
    / "manifests"
    / "samples"
    / "serving_v1alpha1_inferenceservice_cpu.yaml"
)
NAME = "smollm2"
# A few hundred millicores requested (no CPU limit: a rank bursts to the node's two cores), so
# two ranks, the router and the operator fit on one two-CPU node.
SMALL = {"cpu": "300m", "memory": "2Gi", "sharedMemory": "256Mi"}
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def cpu_sample(**spec: Any) -> dict[str, Any]:
    """manifests/samples' CPU InferenceService, with small requests and `spec` merged in."""
    body = yaml.safe_load(SAMPLE.read_text())
    body["spec"]["resources"] = dict(SMALL)
    body["spec"].update(spec)
    return body


@contextmanager
def serving(cluster: Cluster, body: dict[str, Any], timeout: float = 600) -> Iterator[str]:
    """A namespace of its own with `body` applied and Ready; deleted afterwards."""
    namespace = f"e2e-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    try:
        cluster.apply(namespace, body)
        wait_ready(cluster, namespace, body["metadata"]["name"], timeout)
        yield namespace
    finally:
        cluster.kubectl(
            "delete", "namespace", namespace, "--timeout=180s", check=False, timeout=200
        )


def wait_ready(cluster: Cluster, namespace: str, name: str, timeout: float = 600) -> None:
    cluster.kubectl(
        "-n",
        namespace,
        "wait",
        "--for=condition=Ready",
        f"inferenceservice/{name}",
        f"--timeout={int(timeout)}s",
        timeout=timeout + 30,
    )


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (every label set) in an exposition."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return sum(float(value) for value in pattern.findall(text))


def finished_requests(url: str) -> float:
    """Requests a rank has finished, from its /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return metric(text, "sglang:e2e_request_latency_seconds_count")
