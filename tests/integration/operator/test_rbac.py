"""Least privilege: the operator's ClusterRole allows exactly the API calls the operator makes.

A full lifecycle runs against the emulated API (create with every child kind, readiness, a spec
update that prunes, an invalid spec); every request the operator sent (kopf's and its own) is
mapped to (apiGroup, resource, verb) and must be allowed by manifests/rbac/role.yaml, and every
verb the role grants must have been used, except the ones that are only authorized, never called.
"""

from __future__ import annotations

from typing import Any

import yaml

from berth_operator import builders, k8s
from berth_operator import constants as c
from tests.unit.operator.factories import FULL_SPEC, MANIFESTS, parse

from .conftest import ISVC, Cluster, eventually
from .test_operator_kmock import NS, STS, isvc, mark_ready, reason

Rule = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)

# Authorized but never sent as a request: setting ownerReferences with blockOwnerDeletion
# requires `update` on the owner's finalizers subresource (OwnerReferencesPermissionEnforcement),
# and creating the router's Role requires holding what it grants (RBAC escalation prevention).
AUTHORIZATION_ONLY = {
    (c.GROUP, f"{c.PLURAL}/finalizers", "update"),
    ("discovery.k8s.io", "endpointslices", "list"),
    ("discovery.k8s.io", "endpointslices", "watch"),
}

# Used only when a rank's scheduler stalls past its grace, which needs real ranks: the health
# test (test_autoscaling.py) makes that call and checks that the role allows everything it did.
USED_BY_HEALTH_CHECKS = {("", "pods", "delete")}


def role_rules() -> set[Rule]:
    role = yaml.safe_load((MANIFESTS / "rbac" / "role.yaml").read_text())
    assert role["kind"] == "ClusterRole" and role["metadata"]["name"] == "berth-operator"
    granted = set()
    for rule in role["rules"]:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb), "no wildcards"
                    granted.add((group, resource, verb))
    return granted


def request_rule(request: Any) -> Rule | None:
    resource = request.resource
    if resource is None or not resource.plural:
        return None  # discovery (/api, /apis/<group>/<version>): allowed to every user
    plural = resource.plural
    if request.subresource:
        plural = f"{plural}/{request.subresource}"
    method = str(request.method.value if hasattr(request.method, "value") else request.method)
    if method == "GET":
        verb = (
            "watch" if request.params.get("watch") == "true" else "get" if request.name else "list"
        )
    else:
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]
    return (resource.group or "", plural, verb)


def operator_calls(cluster: Cluster) -> set[Rule]:
    calls = set()
    for request in cluster.requests():
        if request.headers.get("User-Agent", "").startswith("kmock/"):
            continue  # the test itself, playing user and controllers
        rule = request_rule(request)
        if rule is not None:
            calls.add(rule)
    return calls


async def test_role_allows_exactly_what_the_operator_does(cluster: Cluster, operator: None) -> None:
    await cluster.create(
        isvc(
            "chat",
            {
                "replicas": 3,
                "ingress": {"host": "chat.example.com"},
                "apiKeySecretRef": {"name": "chat-key"},
            },
        )
    )
    await eventually(lambda: reason(cluster, "chat") == "RanksNotReady")
    await mark_ready(cluster, "chat", ranks=3)
    await eventually(lambda: reason(cluster, "chat") == "Ready")
    await cluster.update_spec(
        NS, "chat", {"replicas": 1, "routing": {"routerReplicas": 0}, "ingress": None}
    )
    await eventually(
        lambda: cluster.names("v1/services", NS) == ["chat", "chat-rank-0", "chat-ranks"]
    )
    await eventually(lambda: cluster.get(ISVC, NS, "chat")["status"]["observedGeneration"] == 2)
    await cluster.create(isvc("broken", {"replicas": -1}))
    await eventually(lambda: reason(cluster, "broken") == "InvalidSpec")
    await eventually(lambda: cluster.get(STS, NS, "chat"))

    calls = operator_calls(cluster)
    granted = role_rules()
    assert sorted(calls - granted) == [], "the operator calls what its role does not allow"
    unused = granted - calls - AUTHORIZATION_ONLY - USED_BY_HEALTH_CHECKS
    assert sorted(unused) == [], "the role allows unused verbs"


def test_role_covers_every_kind_the_builders_emit() -> None:
    granted = role_rules()
    children = builders.build_children(parse(FULL_SPEC))
    assert {child["kind"] for child in children} == {t.kind for t in k8s.CHILD_TYPES}
    for child in children:
        rtype = k8s.resource_type(child)
        for verb in ("create", "patch"):  # server-side apply (create when missing)
            assert (rtype.group, rtype.plural, verb) in granted, (rtype.kind, verb)
    for rtype in k8s.PRUNED_TYPES:
        for verb in ("list", "delete"):
            assert (rtype.group, rtype.plural, verb) in granted, (rtype.kind, verb)
    # Owner references with blockOwnerDeletion need the owner's finalizers.
    if any(
        ref["blockOwnerDeletion"]
        for child in children
        for ref in child["metadata"]["ownerReferences"]
    ):
        assert granted >= AUTHORIZATION_ONLY
    # The operator may only create Roles whose every permission it holds itself.
    for role in (child for child in children if child["kind"] == "Role"):
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert (group, resource, verb) in granted, (role["metadata"], verb)
