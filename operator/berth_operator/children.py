"""Apply one InferenceService's children safely: never over an object it does not own, conflicts
and immutable fields resolved, a child the API server refuses found before anything is written,
leftovers pruned.

The steps, for one set of children built from one generation:

1. Ownership. Every child that exists already must have this InferenceService as its controller.
   An object of the same name that something else owns (another InferenceService, a user's
   Service) is never adopted or overwritten: `NameConflict`, naming each such object.
2. Validation (`validate`, for a new generation): every child is applied with `dryRun=All` first.
   A child the API server refuses (schema, strict field validation, admission, quota) fails the
   whole generation before anything is written.
3. Server-side apply without `force`. A field that another manager took over (a `kubectl edit`
   of our image, say) comes back as a 409 naming it: applied again at once with `force`, which
   restores it. The one exception is the router Deployment's `spec.replicas`, which an HPA or
   `kubectl scale` may own: that field is left to them.
4. An immutable field that changed (a 422 for an object that is valid as a new one, such as a
   StatefulSet made by an earlier operator version) is replaced: deleted (workloads with their
   pods orphaned, so the new one adopts them and no rank loses its pod) and applied again.
5. Owned children that are no longer wanted are deleted (by UID: never a successor).
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from berth_operator import constants as c
from berth_operator import k8s
from berth_operator.spec import InferenceService
from berth_operator.status import APPLY_FAILED, FORBIDDEN, INVALID_SPEC, NAME_CONFLICT

ChildKey = tuple[str, str]  # (kind, name)
Manifest = dict[str, Any]

# A field conflict is answered at once; one that comes back again and again is a fight between
# two controllers, reported instead of fought.
MAX_CONFLICT_ROUNDS = 3
GONE_TIMEOUT_SECONDS = 60.0
GONE_POLL_SECONDS = 0.2
# The namespace is being deleted, the InferenceService with it: nothing to do or to report.
NAMESPACE_TERMINATING = "NamespaceTerminating"
# Workloads replaced for an immutable field keep their pods for the new one to adopt.
ORPHAN_ON_REPLACE = frozenset({"StatefulSet", "Deployment"})


def child_key(obj: Mapping[str, Any]) -> ChildKey:
    return obj["kind"], obj["metadata"]["name"]


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    """The UID of the object's controller (the owner reference with controller: true)."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or ():
        if ref.get("controller"):
            return ref.get("uid")
    return None


def describe(key: ChildKey) -> str:
    return f"{key[0]} {key[1]}"


class ApplyFailure(Exception):
    """A generation that could not be applied, and what the worker should do about it.

    `retrying`: the API server failed or did not answer, so the same request may succeed later
    (backoff). Otherwise someone must act first (fix the spec, free the name, grant access).
    `at_once`: a race (409) that a fresh attempt resolves: retried without waiting.
    """

    def __init__(self, reason: str, message: str, *, retrying: bool, at_once: bool = False) -> None:
        self.reason = reason
        self.message = message
        self.retrying = retrying
        self.at_once = at_once
        super().__init__(f"{reason}: {message}")


@dataclass
class Applied:
    """What one apply did."""

    versions: dict[ChildKey, str] = field(default_factory=dict)  # resourceVersion, as applied
    restored: list[str] = field(default_factory=list)  # fields taken back from other managers
    yielded: list[str] = field(default_factory=list)  # fields left to other managers
    replaced: list[ChildKey] = field(default_factory=list)
    pruned: list[ChildKey] = field(default_factory=list)


@dataclass
class _Plan:
    child: Manifest
    force: bool = False
    replace: bool = False


async def apply(
    kube: k8s.Kube,
    isvc: InferenceService,
    children: Sequence[Manifest],
    known: Mapping[ChildKey, Mapping[str, Any]],
    *,
    validate: bool,
) -> Applied:
    """Apply `children` (built from `isvc`) and prune what they no longer contain.

    `known` holds the children as the watches last showed them (possibly stale or incomplete:
    what is not there is read). Raises ApplyFailure; then, with `validate`, nothing was written.
    """
    result = Applied()
    live = await _existing(kube, isvc, children, known)
    plans = {child_key(child): _Plan(copy.deepcopy(child)) for child in children}
    for key, plan in plans.items():
        current = live.get(key)
        if current is not None and _is_router(plan.child) and _scaled_by_others(current):
            plan.child["spec"].pop("replicas", None)  # an HPA or `kubectl scale` owns it now
    if validate:
        for key, plan in plans.items():
            await _apply_one(kube, plan, live.get(key), result, dry_run=True)
    for key, plan in plans.items():
        current = live.get(key)
        if plan.replace and current is not None:
            await _replace(kube, plan, current, result)
        else:
            await _apply_one(kube, plan, current, result, dry_run=False)
    await _prune(kube, isvc, set(plans), known, result)
    return result


async def _existing(
    kube: k8s.Kube,
    isvc: InferenceService,
    children: Sequence[Manifest],
    known: Mapping[ChildKey, Mapping[str, Any]],
) -> dict[ChildKey, Mapping[str, Any]]:
    """The children that exist already; NameConflict if any of them is not ours."""
    live: dict[ChildKey, Mapping[str, Any]] = {}
    taken = []
    for child in children:
        key = child_key(child)
        rtype = k8s.resource_type(child)
        obj = known.get(key)
        if obj is None:
            try:
                obj = await kube.get(rtype, isvc.namespace, key[1])
            except k8s.ApiError as e:
                raise _failure(e, child, None, "get") from e
        if obj is None:
            continue
        owner = controller_uid(obj)
        if owner != isvc.uid:
            taken.append(f"{describe(key)} ({_owner_text(obj)})")
            continue
        if (obj.get("metadata") or {}).get("deletionTimestamp"):
            # Ours, on its way out (a replacement under way): let it go, then create it anew.
            await _wait_gone(kube, rtype, isvc.namespace, key[1], _uid(obj))
            continue
        live[key] = obj
    if taken:
        raise ApplyFailure(
            NAME_CONFLICT,
            "these names are taken by objects this InferenceService does not own, which it "
            f"never adopts or overwrites: {'; '.join(taken)}. Delete or rename them, or rename "
            "the InferenceService",
            retrying=False,
        )
    return live


def _owner_text(obj: Mapping[str, Any]) -> str:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or ():
        if ref.get("controller"):
            return f"controlled by {ref.get('kind')} {ref.get('name')}"
    return "not created by this InferenceService"


async def _apply_one(
    kube: k8s.Kube,
    plan: _Plan,
    current: Mapping[str, Any] | None,
    result: Applied,
    *,
    dry_run: bool,
) -> None:
    key = child_key(plan.child)
    for _ in range(MAX_CONFLICT_ROUNDS):
        try:
            answer = await kube.apply(plan.child, force=plan.force, dry_run=dry_run)
        except k8s.ApiError as e:
            if e.field_conflict:
                _resolve_conflict(plan, e, result, dry_run=dry_run)
                continue
            if e.status == 422 and current is not None and await _valid_as_new(kube, plan.child):
                # Valid by itself, refused as a change: an immutable field differs.
                plan.replace = True
                if not dry_run:
                    await _replace(kube, plan, current, result)
                return
            raise _failure(e, plan.child, current, "create" if current is None else "patch") from e
        if not dry_run:
            version = (answer.get("metadata") or {}).get("resourceVersion")
            if version:
                result.versions[key] = version
        return
    raise ApplyFailure(
        APPLY_FAILED,
        f"{describe(key)}: its fields keep being taken over by another field manager",
        retrying=True,
    )


def _resolve_conflict(plan: _Plan, error: k8s.ApiError, result: Applied, *, dry_run: bool) -> None:
    """Leave the router's replicas to whoever scales it; take every other field back."""
    key = child_key(plan.child)
    fields = dict(error.conflicts)
    if _is_router(plan.child) and ".spec.replicas" in fields:
        plan.child["spec"].pop("replicas", None)
        if not dry_run:
            result.yielded.append(f"{describe(key)}: .spec.replicas ({fields['.spec.replicas']})")
        del fields[".spec.replicas"]
        if not fields:
            return
    plan.force = True
    if not dry_run:
        taken = "; ".join(f"{f} ({why})" for f, why in fields.items())
        result.restored.append(f"{describe(key)}: {taken}")


def _is_router(child: Mapping[str, Any]) -> bool:
    labels = (child.get("metadata") or {}).get("labels") or {}
    return child.get("kind") == "Deployment" and labels.get(c.LABEL_ROLE) == c.ROLE_ROUTER


def _scaled_by_others(current: Mapping[str, Any]) -> bool:
    """Whether another field manager owns `spec.replicas` (through /scale or otherwise)."""
    for entry in (current.get("metadata") or {}).get("managedFields") or ():
        if entry.get("manager") == c.FIELD_MANAGER:
            continue
        spec = ((entry.get("fieldsV1") or {}).get("f:spec")) or {}
        if "f:replicas" in spec:
            return True
    return False


async def _valid_as_new(kube: k8s.Kube, child: Manifest) -> bool:
    """Whether the API server would accept `child` as a new object (dry run, nothing stored)."""
    try:
        await kube.create_dry_run(child)
    except k8s.ApiError as e:
        if e.already_exists:
            return True
        if e.invalid:
            return False
        raise _failure(e, child, None, "create") from e
    return True


async def _replace(
    kube: k8s.Kube, plan: _Plan, current: Mapping[str, Any], result: Applied
) -> None:
    """Delete and apply again; workloads leave their pods to the new object to adopt."""
    child = plan.child
    key = child_key(child)
    rtype = k8s.resource_type(child)
    namespace = child["metadata"]["namespace"]
    propagation = "Orphan" if key[0] in ORPHAN_ON_REPLACE else "Background"
    try:
        await kube.delete(rtype, namespace, key[1], uid=_uid(current), propagation=propagation)
        await _wait_gone(kube, rtype, namespace, key[1], _uid(current))
        answer = await kube.apply(child, force=True)
    except k8s.ApiError as e:
        raise _failure(e, child, None, "create") from e
    result.replaced.append(key)
    version = (answer.get("metadata") or {}).get("resourceVersion")
    if version:
        result.versions[key] = version


async def _wait_gone(
    kube: k8s.Kube, rtype: k8s.ResourceType, namespace: str, name: str, uid: str | None
) -> None:
    deadline = time.monotonic() + GONE_TIMEOUT_SECONDS
    while True:
        try:
            obj = await kube.get(rtype, namespace, name)
        except k8s.ApiError as e:
            raise ApplyFailure(
                APPLY_FAILED, f"reading {rtype.kind} {name}: {e}", retrying=True
            ) from e
        if obj is None or (uid is not None and _uid(obj) != uid):
            return
        if time.monotonic() > deadline:
            raise ApplyFailure(
                APPLY_FAILED,
                f"{rtype.kind} {name} is still being deleted after {GONE_TIMEOUT_SECONDS:.0f}s",
                retrying=True,
            )
        await asyncio.sleep(GONE_POLL_SECONDS)


async def _prune(
    kube: k8s.Kube,
    isvc: InferenceService,
    wanted: set[ChildKey],
    known: Mapping[ChildKey, Mapping[str, Any]],
    result: Applied,
) -> None:
    for key, obj in known.items():
        if key in wanted or controller_uid(obj) != isvc.uid:
            continue
        if (obj.get("metadata") or {}).get("deletionTimestamp"):
            continue
        rtype = k8s.KIND_TYPES.get(key[0])
        if rtype is None:
            continue
        try:
            deleted = await kube.delete(rtype, isvc.namespace, key[1], uid=_uid(obj))
        except k8s.ApiError as e:
            raise _failure(e, obj, obj, "delete") from e
        if deleted:
            result.pruned.append(key)


def _uid(obj: Mapping[str, Any]) -> str | None:
    return (obj.get("metadata") or {}).get("uid")


def _failure(
    error: k8s.ApiError, child: Mapping[str, Any], current: Mapping[str, Any] | None, verb: str
) -> ApplyFailure:
    """What an API error on one child means for the whole generation."""
    rtype = k8s.resource_type(child)
    name = child["metadata"]["name"]
    namespace = child["metadata"].get("namespace", "")
    if error.invalid:
        return ApplyFailure(
            INVALID_SPEC,
            f"the API server rejected {rtype.kind} {name}: {error.message}",
            retrying=False,
        )
    if error.namespace_terminating:
        return ApplyFailure(
            NAMESPACE_TERMINATING, f"namespace {namespace} is being deleted", retrying=False
        )
    if error.forbidden:
        return ApplyFailure(
            FORBIDDEN,
            f"{verb} {rtype.resource} {namespace}/{name} was refused: {error.message}",
            retrying=False,
        )
    if error.status == 409:  # lost a race (created or replaced meanwhile): look again, now
        return ApplyFailure(
            APPLY_FAILED, f"{rtype.kind} {name}: {error.message}", retrying=True, at_once=True
        )
    return ApplyFailure(
        APPLY_FAILED,
        f"{verb} {rtype.resource} {namespace}/{name} failed: {error}",
        retrying=True,
    )
