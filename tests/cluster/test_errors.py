"""Each kind of API error gets its own treatment, provoked on the real API server:

- 403 (RBAC, a ResourceQuota, an admission webhook's denial): a condition naming the verb and the
  resource, retried now and then; the service comes up once the cause is gone;
- 409 (a field another manager took over): applied again at once;
- 422 for an immutable field (a child made by an earlier operator version): the child is
  replaced; a StatefulSet is deleted with its pods orphaned and re-created, so they are adopted;
- 5xx (a failing admission webhook): retried with exponential backoff.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from typing import Any

import pytest

from berth_operator import builders
from berth_operator import constants as c
from berth_operator.spec import InferenceService
from tests.cluster import conftest, running_operator
from tests.cluster.controlplane import ControlPlane
from tests.cluster.helpers import (
    apply,
    condition,
    events,
    eventually,
    get,
    isvc,
    pods,
    rank_selector,
    wait_condition,
    wait_ready,
)
from tests.cluster.running_operator import USERNAME
from tests.cluster.webhook import ALLOW, FAIL, Call, Webhook, serving

OPERATOR_ROLE = "berth-operator"  # manifests/rbac/role.yaml


def test_a_quota_refusal_is_a_condition_naming_verb_and_resource(
    installed: ControlPlane, serving_namespace: str
) -> None:
    plane, ns, name = installed, serving_namespace, "quota"
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-deployments"},
        "spec": {"hard": {"count/deployments.apps": "0"}},
    }
    apply(plane, ns, quota)
    apply(plane, ns, isvc(name, {}))
    body = wait_condition(plane, ns, name, "Ready", reason="Forbidden")
    message = condition(body, "Ready")["message"]
    assert message.startswith(f"create deployments.apps {ns}/{name}-router was refused: ")
    assert "exceeded quota: no-deployments" in message
    assert condition(body, "Stalled")["status"] == "True"
    assert get(plane, "statefulset", ns, name) is None  # refused in the dry run: nothing applied
    assert [e["reason"] for e in events(plane, ns, name) if e["type"] == "Warning"] == ["Forbidden"]
    plane.kubectl("delete", "resourcequota", "no-deployments", "-n", ns)
    wait_ready(plane, ns, name)


@dataclass(frozen=True)
class Narrowing:
    """An administrator takes `verb` on `resource` away from the operator's role; applying an
    InferenceService with `spec` is then refused, with a message that starts with `refused` and
    says `why`."""

    group: str
    resource: str
    verb: str
    spec: dict[str, Any]
    refused: str  # {ns} and {name} are filled in
    why: str


NARROWINGS = {
    # Applying a missing object creates it: RBAC checks `create` as well as `patch`.
    "create-ingresses": Narrowing(
        "networking.k8s.io",
        "ingresses",
        "create",
        {"ingress": {"host": "unauthorized.example.com"}},
        "create ingresses.networking.k8s.io {ns}/{name} was refused: ",
        f'User "{USERNAME}" cannot create resource "ingresses" in API group "networking.k8s.io"',
    ),
    # Every child's owner reference sets blockOwnerDeletion, which the API server's
    # OwnerReferencesPermissionEnforcement admission allows only with `update` on the owner's
    # finalizers: never a request of its own, so only this shows the rule is needed.
    "update-finalizers": Narrowing(
        c.GROUP,
        f"{c.PLURAL}/finalizers",
        "update",
        {},
        "create services {ns}/{name}-ranks was refused: ",
        "cannot set blockOwnerDeletion if an ownerReference refers to a resource you can't set "
        "finalizers on",
    ),
    # The router's RoleBinding grants berth-router, whose rules the operator does not hold.
    "bind-berth-router": Narrowing(
        "rbac.authorization.k8s.io",
        "clusterroles",
        "bind",
        {},
        "create rolebindings.rbac.authorization.k8s.io {ns}/{name}-router was refused: ",
        "is attempting to grant RBAC permissions not currently held",
    ),
}


def narrowed(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> list:
    """`rules` without `verb` on `resource` (a rule left with no verb goes)."""
    result = []
    for rule in rules:
        if group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]:
            assert rule["apiGroups"] == [group] and rule["resources"] == [resource], rule
            rule = {**rule, "verbs": [v for v in rule["verbs"] if v != verb]}
            if not rule["verbs"]:
                continue
        result.append(rule)
    assert result != rules, f"the role grants no {verb} on {resource}"
    return result


@pytest.mark.parametrize("case", NARROWINGS)
def test_an_rbac_refusal_is_a_condition_naming_verb_and_resource(
    installed: ControlPlane, serving_namespace: str, case: str
) -> None:
    plane, ns, name, narrowing = installed, serving_namespace, "unauthorized", NARROWINGS[case]
    rules = plane.get("clusterrole", OPERATOR_ROLE)["rules"]
    fewer = narrowed(rules, narrowing.group, narrowing.resource, narrowing.verb)

    def set_rules(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> None:
        ops = [
            {"op": "test", "path": "/rules", "value": old},
            {"op": "replace", "path": "/rules", "value": new},
        ]
        plane.kubectl("patch", "clusterrole", OPERATOR_ROLE, "--type=json", "-p", json.dumps(ops))

    # test_rbac_and_load.py lets these refusals through, and no other; and counts the rule as
    # used by the operator.
    since = time.time()
    set_rules(rules, fewer)
    try:
        apply(plane, ns, isvc(name, narrowing.spec))
        body = wait_condition(plane, ns, name, "Ready", reason="Forbidden")
        message = condition(body, "Ready")["message"]
        assert message.startswith(narrowing.refused.format(ns=ns, name=name)), message
        assert narrowing.why in message, message
        assert condition(body, "Stalled")["status"] == "True"
        # Refused in the dry run: nothing of this generation was applied.
        assert get(plane, "statefulset", ns, name) is None
        warnings = [e["reason"] for e in events(plane, ns, name) if e["type"] == "Warning"]
        assert warnings == ["Forbidden"]
    finally:
        set_rules(fewer, rules)
        conftest.RBAC_DENIED_ON_PURPOSE.append(
            (narrowing.group, narrowing.resource, narrowing.verb, since, time.time())
        )
    wait_ready(plane, ns, name)


def test_a_webhook_denial_is_a_condition_with_its_message(
    installed: ControlPlane, serving_namespace: str
) -> None:
    plane, ns, name = installed, serving_namespace, "denied"
    denial = "images from registry.invalid are not allowed in this namespace"
    webhook = Webhook(answer=lambda call: denial if call.user == USERNAME else ALLOW)
    with serving(plane, ns, webhook):
        apply(plane, ns, isvc(name, {}))
        body = wait_condition(plane, ns, name, "Ready", reason="Forbidden")
        message = condition(body, "Ready")["message"]
        assert message.startswith(f"create statefulsets.apps {ns}/{name} was refused: ")
        assert "admission webhook" in message and denial in message
        assert condition(body, "Stalled")["status"] == "True"
        webhook.answer = lambda call: ALLOW
        wait_ready(plane, ns, name)
    # The refused generation was validated (dry run) before anything was written.
    assert all(call.dry_run for call in webhook.calls[:1])


def test_server_errors_are_retried_with_exponential_backoff(
    installed: ControlPlane, serving_namespace: str
) -> None:
    plane, ns, name = installed, serving_namespace, "flaky"
    failures = 3

    def answer(call: Call) -> str:
        mine = [c for c in webhook.calls if c.user == USERNAME]
        return FAIL if call.user == USERNAME and len(mine) <= failures else ALLOW

    webhook = Webhook(answer=answer)
    with serving(plane, ns, webhook):
        apply(plane, ns, isvc(name, {}))
        body = wait_condition(plane, ns, name, "Ready", reason="ApplyFailed")
        message = condition(body, "Ready")["message"]
        assert "failed calling webhook" in message and "500" in message
        # Being retried: Reconciling, not Stalled.
        assert condition(body, "Reconciling")["status"] == "True"
        assert condition(body, "Stalled")["status"] == "False"
        wait_ready(plane, ns, name)
    attempts = [call.time for call in webhook.calls if call.user == USERNAME and call.dry_run]
    assert len(attempts) >= failures + 1
    gaps = [b - a for a, b in zip(attempts, attempts[1 : failures + 1], strict=False)]
    # 1 s, 2 s, 4 s: each wait doubles.
    assert gaps[0] >= 0.8, gaps
    assert all(later >= 1.6 * earlier for earlier, later in zip(gaps, gaps[1:], strict=False)), gaps
    assert max(gaps) < 10, gaps


def test_a_conflict_is_applied_again_at_once(
    installed: ControlPlane, serving_namespace: str
) -> None:
    plane, ns, name = installed, serving_namespace, "conflict"
    apply(plane, ns, isvc(name, {}))
    wait_ready(plane, ns, name)
    since = time.time()
    plane.kubectl("set", "image", "-n", ns, f"statefulset/{name}", "runtime=registry.invalid/x:1")

    def patches() -> list[dict[str, Any]]:
        found = [
            r
            for r in running_operator.requests(plane, since)
            if r["verb"] == "patch"
            and r["objectRef"].get("resource") == "statefulsets"
            and r["objectRef"].get("namespace") == ns
        ]
        assert any(r["responseStatus"]["code"] == 200 for r in found)
        return found

    found = eventually(patches, what="the StatefulSet applied again")
    codes = [r["responseStatus"]["code"] for r in found]
    assert codes[:2] == [409, 200], codes
    assert "force=true" not in found[0]["requestURI"] and "force=true" in found[1]["requestURI"]
    delay = running_operator.unix(found[1]["requestReceivedTimestamp"]) - running_operator.unix(
        found[0]["stageTimestamp"]
    )
    assert delay < 0.5, delay
    sts = get(plane, "statefulset", ns, name)
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] != "registry.invalid/x:1"
    restored = [e["message"] for e in events(plane, ns, name) if e["reason"] == "Restored"]
    assert any("kubectl-set" in m and "image" in m for m in restored), restored


def test_an_immutable_field_replaces_the_child_and_the_ranks_keep_their_pods(
    installed: ControlPlane, serving_namespace: str
) -> None:
    plane, ns, name = installed, serving_namespace, "upgraded"
    # First a spec the operator refuses, so that it applies nothing...
    apply(plane, ns, isvc(name, {"replicas": 2, "runtime": {"extraArgs": ["--mod", "x"]}}))
    body = wait_condition(plane, ns, name, "Ready", reason="InvalidSpec")
    # ...while "an earlier operator version" made the children its way: a StatefulSet with a
    # different (immutable) pod management policy, a RoleBinding to a Role of its own.
    fixed = copy.deepcopy(body)
    fixed["spec"]["runtime"].pop("extraArgs")
    old = builders.build_children(InferenceService.from_body(fixed))
    sts = next(child for child in old if child["kind"] == "StatefulSet")
    sts["spec"]["podManagementPolicy"] = "OrderedReady"
    binding = next(child for child in old if child["kind"] == "RoleBinding")
    binding["roleRef"] = {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": f"{name}-router",
    }
    for child in (sts, binding):
        plane.kubectl(
            "apply",
            "--server-side",
            f"--field-manager={c.FIELD_MANAGER}",
            "-f",
            "-",
            stdin=json.dumps(child),
        )
    eventually(
        lambda: [
            p for p in pods(plane, ns, rank_selector(name)) if p["status"].get("phase") == "Running"
        ][1:],
        60,
        "the old StatefulSet's two pods",
    )
    before = {
        p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(plane, ns, rank_selector(name))
    }
    old_sts_uid = get(plane, "statefulset", ns, name)["metadata"]["uid"]

    # The new operator takes over the fixed spec: both children differ in an immutable field.
    apply(plane, ns, isvc(name, {"replicas": 2}))
    wait_ready(plane, ns, name)
    new_sts = get(plane, "statefulset", ns, name)
    assert new_sts["metadata"]["uid"] != old_sts_uid
    assert new_sts["spec"]["podManagementPolicy"] == "Parallel"
    assert get(plane, "rolebinding", ns, f"{name}-router")["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": c.ROUTER_CLUSTER_ROLE,
    }
    # No rank lost its pod: the same pods, adopted by the new StatefulSet.
    after = pods(plane, ns, rank_selector(name))
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in after} == before
    assert {p["metadata"]["ownerReferences"][0]["uid"] for p in after} == {
        new_sts["metadata"]["uid"]
    }
    replaced = [e["message"] for e in events(plane, ns, name) if e["reason"] == "Replaced"]
    assert (
        replaced
        and f"StatefulSet {name}" in replaced[0]
        and f"RoleBinding {name}-router" in replaced[0]
    )
