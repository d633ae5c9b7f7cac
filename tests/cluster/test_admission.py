"""Bad input: the API server refuses what the CRD can say is wrong, with the message `kubectl
apply` shows; the operator reports the rest as InvalidSpec once, and never retries it in a loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster import running_operator
from tests.cluster.controlplane import ControlPlane
from tests.cluster.helpers import (
    apply,
    children,
    condition,
    events,
    get,
    isvc,
    wait_condition,
    wait_ready,
)
from tests.cluster.running_operator import RunningOperator

QUIET_SECONDS = 6.0  # longer than a retry with backoff would wait


@pytest.fixture(scope="module")
def admission_namespace(installed: ControlPlane) -> Iterator[str]:
    installed.kubectl("create", "namespace", "admission")
    yield "admission"
    installed.kubectl("delete", "namespace", "admission", "--wait=false", check=False)


@pytest.mark.parametrize(
    ("name", "spec", "messages"),
    [
        (
            "dup-env",
            {"runtime": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}},
            ['spec.runtime.env[1]: Duplicate value: {"name":"A"}'],
        ),
        (
            "our-env",
            {"runtime": {"env": [{"name": "HF_HUB_OFFLINE", "value": "0"}]}},
            ["spec.runtime.env[0]: Invalid value", "HF_HUB_OFFLINE are set by the operator"],
        ),
        (
            "dup-pull-secrets",
            {"runtime": {"imagePullSecrets": [{"name": "regcred"}, {"name": "regcred"}]}},
            ['spec.runtime.imagePullSecrets[1]: Duplicate value: {"name":"regcred"}'],
        ),
        (
            "dup-spread",
            {
                "scheduling": {
                    "topologySpreadConstraints": [
                        {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"},
                        {"maxSkew": 2, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"},
                    ]
                }
            },
            [
                "spec.scheduling.topologySpreadConstraints[1]: Duplicate value: "
                '{"topologyKey":"zone","whenUnsatisfiable":"DoNotSchedule"}'
            ],
        ),
        (
            "min-above-max",
            {"autoscaling": {"enabled": True, "minReplicas": 5}},
            [
                "spec.autoscaling: Invalid value",
                "minReplicas must not exceed autoscaling.maxReplicas",
            ],
        ),
        (
            "cuda-without-gpus",
            {"runtime": {"args": {"device": "cuda"}}},
            ["runtime.args.device cuda needs resources.gpus of at least 1"],
        ),
        (
            "other-builtin",
            {"model": {"uri": "builtin://llama"}},
            [
                "spec.model: Invalid value",
                "the runtime embeds builtin://smollm2-135m-instruct only",
            ],
        ),
        (
            "negative",
            {"replicas": -1},
            ["spec.replicas: Invalid value: -1", "greater than or equal to 0"],
        ),
        (
            "a" * 46,
            {},
            ["metadata.name must be at most 45 characters"],
        ),
        # Strict field validation against the CRD's published OpenAPI schema, which the kubectl
        # built with the control plane (the API server's version) checks before sending.
        (
            "typo",
            {"replcas": 2},
            ['unknown field "replcas" in dev.berth.serving.v1alpha1.InferenceService.spec'],
        ),
    ],
    ids=lambda value: value if isinstance(value, str) and len(value) < 40 else None,
)
def test_the_api_server_rejects_invalid_inference_services(
    installed: ControlPlane,
    admission_namespace: str,
    name: str,
    spec: dict[str, Any],
    messages: list[str],
) -> None:
    result = apply(installed, admission_namespace, isvc(name, spec), check=False)
    assert result.returncode != 0
    for message in messages:
        assert message in result.stderr, result.stderr
    assert get(installed, "bis", admission_namespace, name) is None


def child_requests(requests: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    return [
        r
        for r in requests
        if (r.get("objectRef") or {}).get("namespace") == namespace
        and (r.get("objectRef") or {}).get("resource") not in ("events", None)
    ]


@pytest.mark.parametrize(
    ("spec", "messages"),
    [
        # A prefix of an operator-owned flag: argparse would take it for --model.
        (
            {"runtime": {"extraArgs": ["--mod", "llama"]}},
            ["spec.runtime.extraArgs[0]: --mod (read as --model) is set by the operator"],
        ),
        # Misspelt keys inside pass-through fields: the CRD keeps them (as in a Pod spec, they
        # are free-form there); strict field validation of the rank StatefulSet finds them.
        (
            {"scheduling": {"affinity": {"nodeAfinity": {}}}},
            [
                "the API server rejected StatefulSet strict",
                ".spec.template.spec.affinity.nodeAfinity: field not declared in schema",
            ],
        ),
        (
            {
                "runtime": {
                    "env": [
                        {"name": "TOKEN", "valueFrom": {"secretKeyRf": {"name": "s", "key": "k"}}}
                    ]
                }
            },
            [
                '.spec.template.spec.containers[name="runtime"].env[name="TOKEN"]'
                ".valueFrom.secretKeyRf: field not declared in schema"
            ],
        ),
    ],
    ids=["managed-flag-prefix", "affinity-typo", "value-from-typo"],
)
def test_what_admission_cannot_catch_is_an_invalid_spec_reported_once(
    installed: ControlPlane,
    serving_namespace: str,
    berth_operator: RunningOperator,
    spec: dict[str, Any],
    messages: list[str],
) -> None:
    plane, ns, name = installed, serving_namespace, "strict"
    apply(plane, ns, isvc(name, spec))
    body = wait_condition(plane, ns, name, "Ready", reason="InvalidSpec")
    ready = condition(body, "Ready")
    for message in messages:
        assert message in ready["message"]
    assert condition(body, "Stalled")["status"] == "True"
    assert body["status"]["observedGeneration"] == 1
    assert children(plane, ns, name) == {kind: [] for kind in children(plane, ns, name)}

    # Reported once: one Warning Event, then nothing, not even a retry, until the spec changes.
    since = time.time()
    time.sleep(QUIET_SECONDS)
    later = child_requests(running_operator.requests(plane, since), ns)
    assert later == [], [(r["verb"], r["requestURI"]) for r in later]
    status_writes = [
        r
        for r in running_operator.requests(plane, since)
        if (r.get("objectRef") or {}).get("subresource") == "status"
        and (r.get("objectRef") or {}).get("namespace") == ns
    ]
    assert status_writes == []
    warnings = [e for e in events(plane, ns, name) if e["type"] == "Warning"]
    assert [e["reason"] for e in warnings] == ["InvalidSpec"]
    assert warnings[0].get("count", 1) == 1

    # Fixed, it comes up at once: the operator never gave up on it.
    apply(plane, ns, isvc(name, {}))
    body = wait_ready(plane, ns, name)
    assert body["status"]["observedGeneration"] == 2
    assert condition(body, "Stalled")["status"] == "False"
