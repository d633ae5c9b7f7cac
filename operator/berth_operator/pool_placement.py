"""Placing an InferenceService's ranks in its AcceleratorPools: merge each pool's settings into
the spec, and grant ranks under the pools' limits (`quota.Ledger`), pool by pool.

The merge works on the spec as written (stored), so that "unset" means what the user left out:
the pool's defaults fill those fields, the InferenceService's own values win, and a field the
pool locks must be left unset or equal the pool's value. The pool's placement (nodeSelector,
node affinity, tolerations, priorityClassName) and accelerator always apply; the service's own
scheduling is added to them (both must hold).

Which pool: ranks go to the first listed pool with room, and the ranks it has no room for to the
next, each pool holding one rank set (a StatefulSet) of consecutive ranks. Ranks that run stay
where they are (moving one would restart it): fewer ranks are taken from the highest, in the
last rank set; more ranks go to the last rank set while its pool has room, then to new rank sets
in the listed pools not used yet, in order. Pools that do not exist, do not admit the
namespace, conflict with the spec, or cannot fit one rank are skipped; when none is left the
service is refused (`PlacementError`) and nothing is created.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from berth_operator.nodes import NodeView, largest_node, matching
from berth_operator.plan import RankSet
from berth_operator.quota import POOL_SCOPE, Claim, Grant, Ledger, Waiting
from berth_operator.spec import InferenceService, SpecError
from berth_operator.spec.pool import CPU_RESOURCE, AcceleratorPool

REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"

POOL_NOT_FOUND = "PoolNotFound"
POOL_NOT_ALLOWED = "PoolNotAllowed"
POOL_CONFLICT = "PoolConflict"
POOL_TOO_SMALL = "PoolTooSmall"
POOL_INVALID = "PoolInvalid"
REASONS = frozenset({POOL_NOT_FOUND, POOL_NOT_ALLOWED, POOL_CONFLICT, POOL_TOO_SMALL, POOL_INVALID})


class PlacementError(Exception):
    """No listed pool can take the service; `reason` is the first pool's."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class PoolView:
    """What placement reads of the cluster: pools by name (as stored), namespace labels, Nodes."""

    pools: Callable[[], Mapping[str, Mapping[str, Any]]]
    namespace_labels: Callable[[str], Mapping[str, str]]
    nodes: Callable[[], Sequence[NodeView]]


@dataclass(frozen=True)
class Placement:
    rank_sets: tuple[RankSet, ...]  # in rank order; at least one
    grant: Grant

    @property
    def isvc(self) -> InferenceService:
        """The service as placed in its first pool (what does not depend on the pool)."""
        return self.rank_sets[0].isvc


@dataclass(frozen=True)
class _Candidate:
    pool: AcceleratorPool
    per_rank: int
    isvc: InferenceService


def place(
    body: Mapping[str, Any],
    isvc: InferenceService,
    view: PoolView,
    ledger: Ledger,
    wanted: int,
    *,
    default_image: str | None = None,
) -> Placement:
    """Decide and reserve the service's rank sets: at most `wanted` ranks, under every limit.
    Raises PlacementError when no listed pool can take it."""
    key = (isvc.namespace, isvc.name)
    labels = view.namespace_labels(isvc.namespace)
    created = str((body.get("metadata") or {}).get("creationTimestamp") or "")
    holdings = ledger.holdings(key)
    candidates, refusals = _candidates(body, isvc, view, labels, set(holdings), default_image)
    if not candidates:
        ledger.stop_waiting(key)
        reason = refusals[0][0] if refusals else POOL_NOT_FOUND
        raise PlacementError(
            reason, "no pool can take the ranks: " + "; ".join(m for _, m in refusals)
        )
    by_name = {c.pool.name: c for c in candidates}
    # What runs stays, in rank order, cut from the top when fewer ranks are wanted.
    sets: list[_Growing] = []
    remaining = wanted
    for claim in sorted(holdings.values(), key=lambda claim: claim.start):
        candidate = by_name.get(claim.pool)
        if candidate is None:
            continue  # no longer listed (or refused): its ranks go
        take = min(remaining, claim.accelerators // candidate.per_rank)
        if take > 0:
            sets.append(_Growing(candidate, take))
            remaining -= take
    # More ranks: the last rank set grows (ranks stay numbered in order), then new rank sets
    # open in the listed pools it does not use yet, in order, each up to its room.
    limits: list[str] = []
    waiting: list[Waiting] = []
    used = {entry.candidate.pool.name for entry in sets}
    order = [sets[-1]] if sets else []
    order += [_Growing(c, 0) for c in candidates if c.pool.name not in used]
    for entry in order:
        if remaining == 0:
            break
        candidate, have = entry.candidate, entry.count
        room = ledger.room(candidate.pool, key, labels, created, candidate.per_rank)
        total = max(have, min(have + remaining, room.ranks))
        if total < have + remaining:
            limits.append(room.limit or "")
            unmet = (have + remaining - total) * candidate.per_rank
            waiting.append(Waiting(candidate.pool.name, created, unmet, room.scope or POOL_SCOPE))
        remaining -= total - have
        entry.count = total
        if have == 0 and total > 0:
            sets.append(entry)
    if not sets:
        sets = [_Growing(candidates[0], 0)]  # nothing fits yet: an empty rank set in the first pool
    rank_sets = []
    start = 0
    for index, entry in enumerate(sets):
        candidate = entry.candidate
        rank_sets.append(
            RankSet(
                candidate.isvc, candidate.pool.name, candidate.per_rank, index, start, entry.count
            )
        )
        start += entry.count
    claims = tuple(Claim(key[0], key[1], r.pool, r.count * r.per_rank, r.start) for r in rank_sets)
    ledger.reserve(key, claims, tuple(waiting) if remaining else ())
    granted = wanted - remaining
    limit = None
    if remaining:
        limit = "; ".join(limits) + f"; {granted} of {wanted} ranks fit"
    pools = tuple((r.pool, r.count) for r in rank_sets)
    return Placement(tuple(rank_sets), Grant(pools, granted, wanted, limit))


@dataclass
class _Growing:
    """A rank set while `place` decides it: its pool (as a candidate) and its ranks so far."""

    candidate: _Candidate
    count: int


def place_for_render(
    body: Mapping[str, Any], pools: Sequence[Mapping[str, Any]], default_image: str | None
) -> tuple[InferenceService, Placement | None]:
    """`berth operator render`: the service, and its placement when it lists pools, with no
    cluster to ask (no Nodes, no claims, namespace labels unknown)."""
    isvc = InferenceService.from_body(body, default_image=default_image)
    if not isvc.spec.pools:
        return isvc, None
    by_name = {(p.get("metadata") or {}).get("name"): p for p in pools}
    view = PoolView(lambda: by_name, lambda _: {}, lambda: ())
    return isvc, place(body, isvc, view, Ledger(), isvc.spec.ranks, default_image=default_image)


def _candidates(
    body: Mapping[str, Any],
    isvc: InferenceService,
    view: PoolView,
    labels: Mapping[str, str],
    held: set[str],
    default_image: str | None,
) -> tuple[list[_Candidate], list[tuple[str, str]]]:
    pools = view.pools()
    nodes = view.nodes()
    raw_refs = {r.get("name"): r for r in ((body.get("spec") or {}).get("pools") or [])}
    candidates: list[_Candidate] = []
    refusals: list[tuple[str, str]] = []
    for ref in isvc.spec.pools:
        raw = pools.get(ref.name)
        if raw is None:
            refusals.append((POOL_NOT_FOUND, f"pool {ref.name}: no AcceleratorPool of that name"))
            continue
        try:
            pool = AcceleratorPool.from_body(raw)
        except SpecError as e:
            refusals.append((POOL_INVALID, f"pool {ref.name}: invalid ({e})"))
            continue
        spec = pool.spec
        if not spec.limits.allows(isvc.namespace, labels):
            allowed = spec.limits.allowed_namespaces
            who = allowed.describe() if allowed is not None else "every namespace"
            refusals.append(
                (
                    POOL_NOT_ALLOWED,
                    f"pool {ref.name}: namespace {isvc.namespace} may not use it (allowed: {who})",
                )
            )
            continue
        per_rank = ref.accelerators_per_rank or spec.accelerator.per_rank
        if spec.accelerator.resource != "cpu" and not ref.accelerators_per_rank:
            # A tensor-parallel rank needs one accelerator per process.
            per_rank = max(per_rank, isvc.spec.parallelism.tensor)
        # A pool the service has ranks in stays usable when a limit is lowered under them.
        too_small = (
            None if ref.name in held else _too_small(pool, per_rank, isvc.namespace, labels, nodes)
        )
        if too_small:
            refusals.append((POOL_TOO_SMALL, too_small))
            continue
        spec_raw = body.get("spec") or {}
        merged, conflicts = merged_spec(spec_raw, pool, raw_refs.get(ref.name) or {}, per_rank)
        if conflicts:
            refusals.append((POOL_CONFLICT, f"pool {ref.name}: " + "; ".join(conflicts)))
            continue
        try:
            placed = InferenceService.from_body(
                {**body, "spec": merged},
                default_image=default_image,
                router_image=isvc.router_image,
            )
        except SpecError as e:
            refusals.append((POOL_CONFLICT, f"pool {ref.name}: the merged spec is invalid: {e}"))
            continue
        placed = dataclasses.replace(
            placed, spec=dataclasses.replace(placed.spec, pools=isvc.spec.pools)
        )
        candidates.append(_Candidate(pool, per_rank, placed))
    return candidates, refusals


def _too_small(
    pool: AcceleratorPool,
    per_rank: int,
    namespace: str,
    labels: Mapping[str, str],
    nodes: Sequence[NodeView],
) -> str | None:
    spec = pool.spec
    resource = spec.accelerator.resource
    need = f"a rank needs {per_rank} {resource}"
    limits = spec.limits
    if limits.max_accelerators is not None and per_rank > limits.max_accelerators:
        return f"pool {pool.name}: {need}, over limits.maxAccelerators {limits.max_accelerators}"
    found = limits.namespace_limit(namespace, labels)
    if found is not None and per_rank > found[1]:
        return (
            f"pool {pool.name}: {need}, over limits.namespaces[{found[0]}].maxAccelerators "
            f"{found[1]} for namespace {namespace}"
        )
    matched = matching(spec, nodes)
    if matched and per_rank > (largest := largest_node(spec, matched)):
        return f"pool {pool.name}: {need}, and its largest node has {largest}"
    return None


def merged_spec(
    spec: Mapping[str, Any], pool: AcceleratorPool, ref: Mapping[str, Any], per_rank: int
) -> tuple[dict[str, Any], list[str]]:
    """The InferenceService spec with the pool's settings merged in, and the locked fields it
    sets otherwise (each named with both values)."""
    out: dict[str, Any] = copy.deepcopy(dict(spec))
    out.pop("pools", None)
    conflicts: list[str] = []
    pool_spec = pool.spec
    defaults = pool.raw_spec.get("defaults") or {}
    runtime = out.setdefault("runtime", {})
    resources = out.setdefault("resources", {})
    scheduling = out.setdefault("scheduling", {})

    def fill(field: str, where: str, container: dict[str, Any], key: str, value: Any) -> None:
        """The pool's value where the service has none; the only one allowed when locked."""
        if pool_spec.is_locked(field):
            if key in container and container[key] != value:
                conflicts.append(
                    f"{field} is locked to {_show(value)}; {where} sets {_show(container[key])}"
                )
            if value is None:
                container.pop(key, None)
            else:
                container[key] = value
        elif value is not None:
            container.setdefault(key, value)

    fill("image", "runtime.image", runtime, "image", defaults.get("image"))
    fill(
        "sharedMemory",
        "resources.sharedMemory",
        resources,
        "sharedMemory",
        defaults.get("sharedMemory"),
    )
    args = runtime.setdefault("args", {})
    pool_args = defaults.get("args") or {}
    for name in sorted(set(pool_args) | set(args)):
        fill(f"args.{name}", f"runtime.args.{name}", args, name, pool_args.get(name))
    for name, value in (ref.get("args") or {}).items():
        if pool_spec.is_locked(f"args.{name}") and value != pool_args.get(name):
            conflicts.append(
                f"args.{name} is locked to {_show(pool_args.get(name))}; "
                f"pools[{pool.name}].args.{name} sets {_show(value)}"
            )
        else:
            args[name] = value
    env = list(runtime.get("env") or [])
    for variable in defaults.get("env") or []:
        same = next((i for i, e in enumerate(env) if e.get("name") == variable.get("name")), None)
        if same is None:
            env.append(variable)
        elif pool_spec.is_locked("env") and env[same] != variable:
            conflicts.append(
                f"env is locked: variable {variable.get('name')} must be {_show(variable)}"
            )
    if env:
        runtime["env"] = env
    if pool_spec.is_locked("acceleratorsPerRank") and per_rank != pool_spec.accelerator.per_rank:
        conflicts.append(
            f"acceleratorsPerRank is locked to {pool_spec.accelerator.per_rank}; "
            f"pools[{pool.name}] asks for {per_rank}"
        )

    resource = pool_spec.accelerator.resource
    if resource == CPU_RESOURCE:
        resources["gpus"] = 0
        resources["cpu"] = str(per_rank)
    else:
        resources["gpus"] = per_rank
        resources["gpuResource"] = resource

    node_selector = dict(scheduling.get("nodeSelector") or {})
    for key, value in pool_spec.node_selector:
        if key in node_selector and node_selector[key] != value:
            conflicts.append(
                f"nodeSelector {key} is {value!r} in the pool; scheduling.nodeSelector sets "
                f"{node_selector[key]!r}"
            )
        node_selector[key] = value
    if node_selector:
        scheduling["nodeSelector"] = node_selector
    tolerations = list(scheduling.get("tolerations") or [])
    tolerations += [t for t in pool_spec.tolerations if t not in tolerations]
    if tolerations:
        scheduling["tolerations"] = tolerations
    if pool_spec.priority_class_name:
        fill_priority = scheduling.get("priorityClassName")
        if fill_priority not in (None, pool_spec.priority_class_name):
            conflicts.append(
                f"priorityClassName is {pool_spec.priority_class_name!r} in the pool; "
                f"scheduling.priorityClassName sets {fill_priority!r}"
            )
        scheduling["priorityClassName"] = pool_spec.priority_class_name
    affinity = both_affinities(pool_spec.pod_affinity, scheduling.get("affinity"))
    if affinity:
        scheduling["affinity"] = affinity
    return out, conflicts


def both_affinities(
    pool: Mapping[str, Any] | None, own: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """One affinity that requires both: the service's own, with the pool's node affinity ANDed
    into its required node terms (terms are ORed, so every pair of terms is joined)."""
    if not pool or not pool.get("nodeAffinity"):
        return dict(own) if own else None
    result = dict(own or {})
    theirs = pool["nodeAffinity"]
    mine = result.get("nodeAffinity") or {}
    pool_terms = (theirs.get(REQUIRED) or {}).get("nodeSelectorTerms") or []
    own_terms = (mine.get(REQUIRED) or {}).get("nodeSelectorTerms") or []
    if pool_terms and own_terms:
        terms = [_join(a, b) for a in pool_terms for b in own_terms]
    else:
        terms = pool_terms or own_terms
    node_affinity: dict[str, Any] = {}
    if terms:
        node_affinity[REQUIRED] = {"nodeSelectorTerms": terms}
    preferred = list(mine.get(PREFERRED) or []) + list(theirs.get(PREFERRED) or [])
    if preferred:
        node_affinity[PREFERRED] = preferred
    result["nodeAffinity"] = node_affinity
    return result


def _join(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    term: dict[str, Any] = {}
    for key in ("matchExpressions", "matchFields"):
        items = list(a.get(key) or []) + list(b.get(key) or [])
        if items:
            term[key] = items
    return term


def _show(value: Any) -> str:
    return repr(value) if not isinstance(value, Mapping) else str(dict(value))
