"""Nodes as an AcceleratorPool sees them: which match its placement, and what they can hold.

A Node matches when it is Ready and schedulable, has the pool's nodeSelector labels, satisfies
its required node affinity (the scheduler's rules: In, NotIn, Exists, DoesNotExist, Gt, Lt, and
metadata.name fields) and has no NoSchedule or NoExecute taint the pool does not tolerate.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from berth_operator.spec.pool import AcceleratorPoolSpec

_SUFFIX = {
    "": 1,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}
_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")


@dataclass(frozen=True)
class NodeView:
    """What of a Node matters to pools."""

    name: str
    labels: Mapping[str, str]
    allocatable: Mapping[str, str]
    taints: tuple[Mapping[str, Any], ...]
    schedulable: bool

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> NodeView:
        meta = body.get("metadata") or {}
        spec = body.get("spec") or {}
        status = body.get("status") or {}
        ready = any(
            cond.get("type") == "Ready" and cond.get("status") == "True"
            for cond in status.get("conditions") or []
        )
        return cls(
            name=meta.get("name", ""),
            labels=dict(meta.get("labels") or {}),
            allocatable=dict(status.get("allocatable") or {}),
            taints=tuple(spec.get("taints") or ()),
            schedulable=ready and not spec.get("unschedulable", False),
        )

    def amount(self, resource: str) -> int:
        """Whole units of `resource` the node can hold (CPU: whole cores)."""
        return quantity_units(self.allocatable.get(resource, "0"))


def quantity_units(text: Any) -> int:
    """A resource quantity in whole units, rounded down ("1500m" -> 1, "8" -> 8)."""
    found = _QUANTITY.match(str(text).strip())
    if not found or found.group(2) not in _SUFFIX:
        return 0
    return math.floor(float(found.group(1)) * _SUFFIX[found.group(2)] + 1e-9)


def matches(spec: AcceleratorPoolSpec, node: NodeView) -> bool:
    if not node.schedulable:
        return False
    if any(node.labels.get(k) != v for k, v in spec.node_selector):
        return False
    required = ((spec.pod_affinity or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms") or []
    if terms and not any(_term_matches(term, node) for term in terms):
        return False
    return all(_tolerated(taint, spec.tolerations) for taint in node.taints)


def matching(spec: AcceleratorPoolSpec, nodes: Iterable[NodeView]) -> list[NodeView]:
    return sorted((n for n in nodes if matches(spec, n)), key=lambda n: n.name)


def largest_node(spec: AcceleratorPoolSpec, nodes: Sequence[NodeView]) -> int:
    """The most of the pool's resource any one matching node holds (a rank fits on one node)."""
    resource = spec.accelerator.resource
    return max((n.amount(resource) for n in nodes), default=0)


def _term_matches(term: Mapping[str, Any], node: NodeView) -> bool:
    expressions = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not expressions and not fields:
        return False  # an empty term matches nothing (the scheduler's rule)
    ok = all(_expression(e, node.labels.get(e.get("key", ""))) for e in expressions)
    for e in fields:
        value = node.name if e.get("key") == "metadata.name" else None
        ok = ok and _expression(e, value)
    return ok


def _expression(expression: Mapping[str, Any], value: str | None) -> bool:
    operator = expression.get("operator")
    values = list(expression.get("values") or [])
    if operator == "In":
        return value is not None and value in values
    if operator == "NotIn":
        return value is None or value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    if operator in ("Gt", "Lt") and value is not None and len(values) == 1:
        try:
            have, bound = int(value), int(values[0])
        except ValueError:
            return False
        return have > bound if operator == "Gt" else have < bound
    return False


def _tolerated(taint: Mapping[str, Any], tolerations: Iterable[Mapping[str, Any]]) -> bool:
    effect = taint.get("effect")
    if effect not in ("NoSchedule", "NoExecute"):
        return True  # PreferNoSchedule only discourages
    for toleration in tolerations:
        if toleration.get("effect") not in (None, "", effect):
            continue
        if toleration.get("operator") == "Exists":
            if not toleration.get("key") or toleration.get("key") == taint.get("key"):
                return True
        elif toleration.get("key") == taint.get("key") and (toleration.get("value") or "") == (
            taint.get("value") or ""
        ):
            return True
    return False
