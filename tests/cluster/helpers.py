"""What the cluster tests do as users and read as users: kubectl, InferenceService bodies,
conditions, polling, and kstatus' documented rules.

Everything here goes through `kubectl` as the admin user, as a person would, so the messages the
tests check are the ones a person sees.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from berth_operator import constants as c
from tests.cluster.controlplane import ControlPlane

T = TypeVar("T")

TIMEOUT = 30.0
# Every kind of child, as `kubectl get` names it.
CHILD_KINDS = (
    "statefulset",
    "deployment",
    "service",
    "poddisruptionbudget",
    "ingress",
    "serviceaccount",
    "rolebinding",
)
KIND_NAMES = {
    "StatefulSet": "statefulset",
    "Deployment": "deployment",
    "Service": "service",
    "PodDisruptionBudget": "poddisruptionbudget",
    "Ingress": "ingress",
    "ServiceAccount": "serviceaccount",
    "RoleBinding": "rolebinding",
}


def eventually(check: Callable[[], T], timeout: float = TIMEOUT, what: str = "") -> T:
    """Poll `check` until it returns something truthy without raising AssertionError/KeyError;
    fail with the last error after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    error: BaseException | None = None
    while True:
        try:
            value = check()
            if value:
                return value
            error = None
        except (AssertionError, KeyError, IndexError, TypeError) as e:
            error = e
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}: {error!r}")
        time.sleep(0.2)


def isvc(name: str, spec: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "metadata": {"name": name},
        "spec": dict(spec or {}),
    }


def apply(
    plane: ControlPlane, namespace: str, *objects: Mapping[str, Any], check: bool = True
) -> Any:
    """`kubectl apply -f -` of `objects`, as a user does (client-side apply)."""
    body = json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)})
    return plane.kubectl("apply", "-n", namespace, "-f", "-", stdin=body, check=check)


def get(plane: ControlPlane, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    result = plane.kubectl(
        "get", kind, name, "-n", namespace, "-o", "json", "--ignore-not-found", check=True
    )
    return json.loads(result.stdout) if result.stdout.strip() else None


def names(plane: ControlPlane, kind: str, namespace: str, selector: str = "") -> list[str]:
    args = ["get", kind, "-n", namespace, "-o", "json"]
    if selector:
        args += ["-l", selector]
    items = json.loads(plane.kubectl(*args).stdout)["items"]
    return sorted(item["metadata"]["name"] for item in items)


def children(plane: ControlPlane, namespace: str, name: str) -> dict[str, list[str]]:
    """Every child of one InferenceService, by kind (found by the operator's labels)."""
    selector = f"{c.LABEL_ISVC}={name},{c.LABEL_MANAGED_BY}={c.MANAGED_BY}"
    result = plane.kubectl(
        "get", ",".join(CHILD_KINDS), "-n", namespace, "-l", selector, "-o", "json"
    )
    found: dict[str, list[str]] = {kind: [] for kind in CHILD_KINDS}
    for item in json.loads(result.stdout)["items"]:
        found[KIND_NAMES[item["kind"]]].append(item["metadata"]["name"])
    return {kind: sorted(items) for kind, items in found.items()}


def condition(obj: Mapping[str, Any] | None, type_: str) -> dict[str, Any]:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return {}


def status_of(plane: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    return (get(plane, "bis", namespace, name) or {}).get("status") or {}


def wait_condition(
    plane: ControlPlane,
    namespace: str,
    name: str,
    type_: str,
    *,
    status: str | None = None,
    reason: str | None = None,
    timeout: float = TIMEOUT,
) -> dict[str, Any]:
    """The InferenceService once its condition has this status and/or reason."""

    def check() -> dict[str, Any] | None:
        obj = get(plane, "bis", namespace, name)
        cond = condition(obj, type_)
        if status is not None and cond.get("status") != status:
            return None
        if reason is not None and cond.get("reason") != reason:
            return None
        return obj if cond else None

    return eventually(check, timeout, f"{namespace}/{name} {type_}={status} ({reason})")


def wait_ready(plane: ControlPlane, namespace: str, name: str, timeout: float = 60) -> dict:
    """`kubectl wait --for=condition=Ready`, as a user would; then the object."""
    plane.kubectl(
        "wait",
        "-n",
        namespace,
        "--for=condition=Ready",
        f"bis/{name}",
        f"--timeout={int(timeout)}s",
        timeout=timeout + 10,
    )
    obj = get(plane, "bis", namespace, name)
    assert obj is not None
    return obj


def pods(plane: ControlPlane, namespace: str, selector: str) -> list[dict[str, Any]]:
    return json.loads(
        plane.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout
    )["items"]


def rank_selector(name: str) -> str:
    return f"{c.LABEL_ISVC}={name},{c.LABEL_ROLE}={c.ROLE_RANK}"


def is_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(cd["type"] == "Ready" and cd["status"] == "True" for cd in conditions)


def events(plane: ControlPlane, namespace: str, name: str) -> list[dict[str, Any]]:
    """The Events about one InferenceService, oldest first."""
    result = plane.kubectl(
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        f"involvedObject.kind={c.KIND},involvedObject.name={name}",
        "-o",
        "json",
    )
    items = json.loads(result.stdout)["items"]
    return sorted(items, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")


def kstatus(obj: Mapping[str, Any]) -> tuple[str, str]:
    """kstatus' status of a custom resource, by its documented rules (cli-utils
    pkg/kstatus/README.md and status.Compute): Terminating while being deleted; InProgress while
    metadata.generation != status.observedGeneration; InProgress on Reconciling=True; Failed on
    Stalled=True; then the Ready condition: True is Current, False or Unknown InProgress; without
    any of these conditions, Current."""
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    if meta.get("deletionTimestamp"):
        return "Terminating", "Resource scheduled for deletion"
    generation = meta.get("generation")
    observed = status.get("observedGeneration")
    if generation is not None and observed is not None and observed != generation:
        return "InProgress", f"generation is {generation}, but observed generation is {observed}"
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Reconciling" and cond.get("status") == "True":
            return "InProgress", cond.get("message", "")
        if cond.get("type") == "Stalled" and cond.get("status") == "True":
            return "Failed", cond.get("message", "")
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Ready":
            if cond.get("status") == "True":
                return "Current", "Resource is Ready"
            return "InProgress", cond.get("message", "")
    return "Current", "Resource is current"


def request_rules(events_: Iterable[Mapping[str, Any]]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource[/subresource], verb) of audited requests to resources."""
    rules = set()
    for event in events_:
        ref = event.get("objectRef") or {}
        resource = ref.get("resource")
        if not resource:
            continue  # discovery (/api, /apis/...): open to every authenticated user
        if ref.get("subresource"):
            resource = f"{resource}/{ref['subresource']}"
        rules.add((ref.get("apiGroup", ""), resource, event["verb"]))
        if event["verb"] == "patch" and event.get("responseStatus", {}).get("code") == 201:
            # Server-side apply of a missing object creates it, authorized as `create` too.
            rules.add((ref.get("apiGroup", ""), resource, "create"))
    return rules
