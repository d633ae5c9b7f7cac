"""What the operator asks of the API server, read from the API server's own audit log: the
shipped RBAC is exactly what it uses, and a steady service costs (next to) nothing.

This module runs last in the package (conftest.py): the RBAC check reads every request the
operator made in all the other cluster tests.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

import pytest
import yaml

from berth_operator import constants as c
from tests.cluster import conftest, running_operator
from tests.cluster.controlplane import REPO_ROOT, ControlPlane
from tests.cluster.helpers import (
    apply,
    eventually,
    isvc,
    pods,
    rank_selector,
    request_rules,
    status_of,
    wait_ready,
)
from tests.cluster.running_operator import USERNAME, RunningOperator
from tests.unit.operator.factories import role_rules

ROLE = REPO_ROOT / "manifests" / "rbac" / "role.yaml"
# Authorized, never sent as requests of their own: owner references with blockOwnerDeletion need
# `update` on the owner's finalizers; binding berth-router needs `bind` on it. No audited request
# shows them used: test_errors.py shows each needed, by taking it away (RBAC_DENIED_ON_PURPOSE).
AUTHORIZATION_ONLY = {
    (c.GROUP, f"{c.PLURAL}/finalizers", "update"),
    ("rbac.authorization.k8s.io", "clusterroles", "bind"),
}
# Used only when a rank's scheduler stalls past its grace, which needs real ranks:
# tests/integration/operator/test_autoscaling.py makes that call against its emulated API.
USED_BY_HEALTH_CHECKS = {("", "pods", "delete")}
# The RBAC authorizer's refusal, as the API server words it in a 403.
RBAC_MESSAGE = re.compile(
    r'cannot (?P<verb>[a-z]+) resource "(?P<resource>[^"]+)" in API group "(?P<group>[^"]*)"'
)
STEADY_WINDOW_SECONDS = 30.0
SERVICES = 3


def rbac_refusal(event: Mapping[str, Any]) -> tuple[str, str, str, str] | None:
    """(namespace, apiGroup, resource, verb) that RBAC refused the operator in this request, if
    any: the request itself (the audit's authorization decision), or a check made while serving
    it, which the audit records as allowed: the `create` that applying a missing object needs,
    the `update` on the owner's finalizers that blockOwnerDeletion needs, the `bind` that
    granting a role one does not hold needs."""
    ref = event.get("objectRef") or {}
    namespace = ref.get("namespace", "")
    if event.get("annotations", {}).get("authorization.k8s.io/decision") == "forbid":
        resource = ref.get("resource", "")
        if ref.get("subresource"):
            resource = f"{resource}/{ref['subresource']}"
        return namespace, ref.get("apiGroup", ""), resource, event["verb"]
    status = event.get("responseStatus") or {}
    message = status.get("message", "") if status.get("code") == 403 else ""
    if found := RBAC_MESSAGE.search(message):
        return namespace, found["group"], found["resource"], found["verb"]
    # Our owner references (InferenceServices) without `update` on their finalizers. (Not the
    # other blockOwnerDeletion refusal, "cannot find RESTMapping", which is the API server's
    # discovery not serving a just-installed CRD yet: transient, and retried.)
    if "refers to a resource you can't set finalizers on" in message:
        return namespace, c.GROUP, f"{c.PLURAL}/finalizers", "update"
    if "attempting to grant RBAC permissions not currently held" in message:
        return namespace, "rbac.authorization.k8s.io", "clusterroles", "bind"
    return None


def narrowed_on_purpose(refusal: tuple[str, str, str, str], event: Mapping[str, Any]) -> bool:
    """Whether a test had taken this verb away when the request came (the role's change reaches
    the authorizer within moments: a second of grace after it is given back)."""
    _, group, resource, verb = refusal
    at = running_operator.unix(event["requestReceivedTimestamp"])
    return any(
        (group, resource, verb) == (g, r, v) and since <= at <= until + 1.0
        for g, r, v, since, until in conftest.RBAC_DENIED_ON_PURPOSE
    )


def granted() -> set[tuple[str, str, str]]:
    role = yaml.safe_load(ROLE.read_text())
    for rule in role["rules"]:
        if "resourceNames" in rule:  # only `bind`, only on the router's role
            assert rule["verbs"] == ["bind"] and rule["resourceNames"] == [c.ROUTER_CLUSTER_ROLE]
    return role_rules()


def settle(plane: ControlPlane, namespace: str, names: list[str]) -> None:
    """Wait until every rank pod has been seen by a scrape (its entry names the pod), then one
    more round: what the status says from then on is steady."""

    def every_rank_scraped() -> bool:
        for name in names:
            ranks = status_of(plane, namespace, name)["ranks"]
            assert len(ranks) == 2 and all(r.get("pod") for r in ranks), ranks
        return True

    eventually(every_rank_scraped, what="a scrape of every rank")
    time.sleep(6)


def test_the_role_allows_exactly_what_the_operator_uses(
    installed: ControlPlane, berth_operator: RunningOperator, request: pytest.FixtureRequest
) -> None:
    requests = installed.audit_events(USERNAME)
    assert requests
    denied = [
        (r["verb"], r["requestURI"])
        for r in requests
        if (refusal := rbac_refusal(r)) and not narrowed_on_purpose(refusal, r)
    ]
    assert denied == [], "RBAC refused the operator"
    used = request_rules(requests)
    assert sorted(used - granted()) == []
    modules = {item.path.name for item in request.session.items}
    everything = {path.name for path in (REPO_ROOT / "tests" / "cluster").glob("test_*.py")}
    if not everything <= modules:
        pytest.skip("the unused-verb check needs every module of tests/cluster/ to have run")
    # A rule whose removal made the operator fail (test_errors.py) is used, audited or not.
    needed = {
        (group, resource, verb) for group, resource, verb, _, _ in conftest.RBAC_DENIED_ON_PURPOSE
    }
    assert needed >= AUTHORIZATION_ONLY, "a rule only authorization uses was not shown needed"
    unused = granted() - used - needed - USED_BY_HEALTH_CHECKS
    assert sorted(unused) == [], f"the role allows what the operator never uses: {sorted(unused)}"


def test_a_steady_service_costs_no_api_requests_and_its_status_is_written_on_change(
    installed: ControlPlane, serving_namespace: str, berth_operator: RunningOperator
) -> None:
    plane, ns = installed, serving_namespace
    names = [f"steady-{i}" for i in range(SERVICES)]
    for name in names:
        apply(plane, ns, isvc(name, {"replicas": 2, "ingress": {"host": f"{name}.example.com"}}))
    for name in names:
        wait_ready(plane, ns, name)

    settle(plane, ns, names)

    def scrape_errors() -> float:
        total = 0.0
        for line in berth_operator.metrics().splitlines():
            if (
                line.startswith("berth_operator_scrape_errors_total{")
                and f'namespace="{ns}"' in line
            ):
                total += float(line.rsplit(" ", 1)[1])
        return total

    scraped_before = scrape_errors()
    statuses = {name: status_of(plane, ns, name) for name in names}
    start = time.time()
    time.sleep(STEADY_WINDOW_SECONDS)
    window = running_operator.requests(plane, start)
    changed = {
        name: {
            key: (statuses[name].get(key), value)
            for key, value in status_of(plane, ns, name).items()
            if statuses[name].get(key) != value
        }
        for name in names
    }
    scraped = scrape_errors() - scraped_before
    # The ranks were scraped all along (kwok's pods do not answer, so every scrape counts as an
    # error), and the statuses stayed the same: nothing was written, nothing read back.
    rounds = STEADY_WINDOW_SECONDS / 5.0  # the installed --observe-interval (default 5 s)
    assert scraped >= SERVICES * 2 * (rounds - 1), scraped
    in_namespace = [r for r in window if (r.get("objectRef") or {}).get("namespace") == ns]
    per_service_minute = len(in_namespace) / SERVICES / (STEADY_WINDOW_SECONDS / 60)
    everywhere = len(window) / (STEADY_WINDOW_SECONDS / 60)
    conftest.REPORTED["api-load"] = (
        f"steady-state API load: {per_service_minute:.2f} requests per InferenceService per "
        f"minute ({len(in_namespace)} in {STEADY_WINDOW_SECONDS:.0f}s for {SERVICES} services, "
        f"2 ranks, router and Ingress each); {everywhere:.2f} requests per minute by the "
        f"operator in all, watches included"
    )
    print(conftest.REPORTED["api-load"])
    assert in_namespace == [], ([(r["verb"], r["requestURI"]) for r in in_namespace], changed)

    # A change is written: a rank pod goes, the status says so, then says it is back.
    since = time.time()
    plane.kubectl("delete", "pod", f"{names[0]}-1", "-n", ns, "--wait=false")

    def status_writes() -> list[dict[str, Any]]:
        writes = [
            r
            for r in running_operator.requests(plane, since)
            if (r.get("objectRef") or {}).get("subresource") == "status"
            and r["objectRef"].get("name") == names[0]
        ]
        assert writes
        return writes

    eventually(status_writes, what="a status write after the pod went")
    wait_ready(plane, ns, names[0])
    assert len(pods(plane, ns, rank_selector(names[0]))) == 2


def test_a_restarted_operator_resumes_every_service_and_changes_nothing(
    installed: ControlPlane, serving_namespace: str, berth_operator: RunningOperator
) -> None:
    plane, ns, name = installed, serving_namespace, "resumed"
    apply(plane, ns, isvc(name, {"replicas": 2, "ingress": {"host": "resumed.example.com"}}))
    wait_ready(plane, ns, name)
    settle(plane, ns, [name])
    kinds = "bis,statefulset,deployment,service,pdb,ingress,serviceaccount,rolebinding"

    def versions() -> dict[str, str]:
        items = plane.get(kinds, "-n", ns)["items"]
        return {
            f"{i['kind']}/{i['metadata']['name']}": i["metadata"]["resourceVersion"] for i in items
        }

    before = versions()
    status_before = status_of(plane, ns, name)
    assert len(before) == 13  # 11 children, the InferenceService, the default ServiceAccount
    # Counted from before the restart: the new operator resumes every service as soon as its
    # first list arrives, which can be before `restart` sees all of its watches open.
    since = time.time()
    assert running_operator.restart(plane, berth_operator) == 0  # SIGTERM: a clean exit

    def resumed() -> bool:
        applies = [
            r
            for r in running_operator.requests(plane, since)
            if r["verb"] == "patch"
            and r["objectRef"].get("namespace") == ns
            and "dryRun" not in r["requestURI"]
            and r["objectRef"].get("subresource") is None
        ]
        assert len(applies) >= 11, len(applies)  # every child applied again...
        return True

    eventually(
        resumed, 90, what="the new operator to apply every child again"
    )  # a cold start on a busy CI machine
    time.sleep(6)  # a scrape by the new operator, too
    status_after = status_of(plane, ns, name)
    changed = {
        key: (status_before.get(key), status_after.get(key))
        for key in {*status_before, *status_after}
        if status_before.get(key) != status_after.get(key)
    }
    # ...and nothing changed: no write, not even the status.
    assert versions() == before, changed
