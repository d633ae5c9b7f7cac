"""Specs that cannot run leave no pod behind: the CRD refuses what its schema can tell at
admission, the operator what only it can tell (with a condition and an Event)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.samples import cpu_sample

# A real cluster is slow: the first test also waits for the node, its image imports and the install.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


def no_pods(cluster: Cluster, namespace: str) -> None:
    assert cluster.get("pods", "-n", namespace)["items"] == []
    assert cluster.get("statefulsets", "-n", namespace)["items"] == []


def test_the_operator_reports_an_invalid_spec_and_starts_nothing(
    installed: Cluster, namespace: str
) -> None:
    body = cpu_sample()
    body["metadata"]["name"] = "broken"
    body["spec"]["runtime"] = {"extraArgs": ["--port", "9000"]}  # only the operator can tell
    installed.apply(namespace, body)
    installed.kubectl(
        "-n",
        namespace,
        "wait",
        "--for=jsonpath={.status.conditions[?(@.type=='Ready')].reason}=InvalidSpec",
        "inferenceservice/broken",
        "--timeout=120s",
        timeout=150,
    )
    events = installed.kubectl(
        "-n", namespace, "get", "events", "--field-selector", "reason=InvalidSpec"
    ).stdout
    assert "--port" in events, events
    no_pods(installed, namespace)


def test_the_crd_refuses_bad_input_at_admission(installed: Cluster, namespace: str) -> None:
    body = cpu_sample()
    body["spec"]["autoscaling"] = {"minReplicas": 5, "maxReplicas": 2}
    result = installed.kubectl(
        "apply", "-n", namespace, "-f", "-", check=False, stdin=json.dumps(body)
    )
    assert result.returncode != 0
    assert "minReplicas must not exceed" in result.stderr
    assert installed.get("inferenceservices", "-n", namespace)["items"] == []
    no_pods(installed, namespace)
