"""The InferenceService's status: conditions, URL and rank counts from the children's real state.

The functions that compute a status are pure (the clock is an argument); `publish` is the only
writer of `.status` and writes nothing when nothing changed, so a resync is a no-op.

Over 400 lines because every condition (Ready, Reconciling, Stalled, Degraded) is derived from the
same observed children in one pass; split up, each would re-derive the rollout state.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from berth_operator import constants as c
from berth_operator import naming
from berth_operator.plan import RankPlan
from berth_operator.quota import Grant
from berth_operator.spec import InferenceService

if TYPE_CHECKING:
    from berth_operator.k8s import Kube

# kstatus' conditions (Ready; Reconciling and Stalled, "abnormal-true"), so that kstatus, Flux
# and `kubectl wait` read the service without knowing it, plus Degraded for what users must fix
# in running pods.
READY = "Ready"
RECONCILING = "Reconciling"
STALLED = "Stalled"
DEGRADED = "Degraded"
# Only while the spec asks for an InferencePool: whether it exists (the CRD may be missing).
INFERENCE_POOL = "InferencePoolReady"
CONDITION_TYPES = (READY, RECONCILING, STALLED, DEGRADED, INFERENCE_POOL)
# Written by earlier versions of the operator; dropped when the status is next written.
RETIRED_TYPES = ("Progressing",)

# Why a generation could not be applied.
INVALID_SPEC = "InvalidSpec"  # the spec, or a child built from it, is invalid: fix the spec
FORBIDDEN = "Forbidden"  # RBAC, a quota or an admission webhook refused a child
NAME_CONFLICT = "NameConflict"  # a child's name is taken by an object this service does not own
QUOTA_EXCEEDED = "QuotaExceeded"  # a pool's limits grant fewer ranks than wanted
APPLY_FAILED = "ApplyFailed"  # the API server failed or did not answer: retried with backoff

# Container states that will not fix themselves: a crash loop, a bad image, a missing Secret.
FAILING_WAITING_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "ContainerCannotRun",
    }
)
MAX_MESSAGE_LENGTH = 1024
RFC3339 = "%Y-%m-%dT%H:%M:%SZ"


@dataclass(frozen=True)
class Observed:
    """The children as last read from the API server (None: not found)."""

    statefulset: Mapping[str, Any] | None = None
    router: Mapping[str, Any] | None = None
    ingress: Mapping[str, Any] | None = None
    pods: Sequence[Mapping[str, Any]] = field(default_factory=tuple)
    # A service placed by pools: each rank set's StatefulSet (the first is `statefulset`) and
    # how many ranks it should run.
    rank_sets: Sequence[tuple[Mapping[str, Any] | None, int]] = ()


@dataclass(frozen=True)
class Live:
    """What the ranks' own metrics say (from the operator's last scrape), for the status."""

    desired: int
    ranks: Sequence[Mapping[str, Any]] = ()
    queued: int = 0
    running: int = 0
    kv_usage: float | None = None  # the fullest rank's, 0-1
    stalled: Mapping[int, str] = field(default_factory=dict)  # rank -> what is wrong
    imbalance: str | None = None
    autoscaler: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Rollout:
    """How far one workload (StatefulSet or Deployment) is from its desired state."""

    desired: int
    current: int
    ready: int
    updated: int
    observed: bool  # the controller has seen the latest spec
    revision_settled: bool  # StatefulSet: every pod runs the update revision

    @property
    def complete(self) -> bool:
        return (
            self.observed
            and self.revision_settled
            and self.current == self.desired
            and self.updated >= self.desired
            and self.ready >= self.desired
        )


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime(RFC3339)


def rollout(workload: Mapping[str, Any] | None, desired: int) -> Rollout:
    if workload is None:
        return Rollout(desired, 0, 0, 0, observed=desired == 0, revision_settled=True)
    meta = workload.get("metadata") or {}
    status = workload.get("status") or {}
    generation = meta.get("generation")
    observed_generation = status.get("observedGeneration")
    observed = generation is None or (
        observed_generation is not None and observed_generation >= generation
    )
    update_revision = status.get("updateRevision")
    settled = update_revision is None or status.get("currentRevision") == update_revision
    return Rollout(
        desired=desired,
        current=int(status.get("replicas") or 0),
        ready=int(status.get("readyReplicas") or 0),
        updated=int(status.get("updatedReplicas") or 0),
        observed=observed,
        revision_settled=settled,
    )


def combined(rollouts: Sequence[Rollout]) -> Rollout:
    """Several StatefulSets of one service's ranks (one per pool) as one."""
    return Rollout(
        desired=sum(r.desired for r in rollouts),
        current=sum(r.current for r in rollouts),
        ready=sum(r.ready for r in rollouts),
        updated=sum(r.updated for r in rollouts),
        observed=all(r.observed for r in rollouts),
        revision_settled=all(r.revision_settled for r in rollouts),
    )


def router_replicas(isvc: InferenceService, deployment: Mapping[str, Any] | None) -> int:
    """The router pods to wait for: the Deployment's own count once it has one, which an HPA
    or `kubectl scale` may own instead of the spec (the operator leaves it to them)."""
    replicas = ((deployment or {}).get("spec") or {}).get("replicas")
    return replicas if isinstance(replicas, int) else isvc.spec.routing.router_replicas


def pod_problems(pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """What keeps pods from ever becoming ready, one line per pod, naming the pod."""
    problems = []
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name", "")):
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        name = meta.get("name", "?")
        status = pod.get("status") or {}
        for cond in status.get("conditions") or []:
            if (
                cond.get("type") == "PodScheduled"
                and cond.get("status") == "False"
                and cond.get("reason") == "Unschedulable"
            ):
                problems.append(f"{name}: Unschedulable: {cond.get('message', '')}".rstrip(": "))
        statuses = [
            *(status.get("initContainerStatuses") or ()),
            *(status.get("containerStatuses") or ()),
        ]
        for cs in statuses:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if reason in FAILING_WAITING_REASONS:
                detail = waiting.get("message") or _last_termination(cs)
                text = f"{name}/{cs.get('name', '?')}: {reason}"
                problems.append(f"{text}: {detail}" if detail else text)
        if status.get("phase") == "Failed":
            problems.append(
                f"{name}: Failed: {status.get('reason') or status.get('message') or ''}"
            )
    return problems


def _last_termination(container_status: Mapping[str, Any]) -> str:
    terminated = (container_status.get("lastState") or {}).get("terminated") or {}
    if not terminated:
        return ""
    code = terminated.get("exitCode")
    reason = terminated.get("reason") or "terminated"
    return f"last exit: {reason} (code {code})"


def condition(
    type_: str,
    status: bool,
    reason: str,
    message: str,
    *,
    generation: int | None,
    previous: Sequence[Mapping[str, Any]],
    now: str,
) -> dict[str, Any]:
    """A metav1.Condition; lastTransitionTime moves only when the status flips."""
    value = "True" if status else "False"
    before = next((p for p in previous if p.get("type") == type_), None)
    since = before.get("lastTransitionTime") if before and before.get("status") == value else None
    result: dict[str, Any] = {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": _clip(message),
        "lastTransitionTime": since or now,
    }
    if generation is not None:
        result["observedGeneration"] = generation
    return result


def _merge_conditions(
    ours: list[dict[str, Any]], previous: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Our conditions first, then any other condition types left by other writers."""
    others = [
        dict(p)
        for p in previous
        if p.get("type") not in CONDITION_TYPES and p.get("type") not in RETIRED_TYPES
    ]
    return ours + others


def compute(
    isvc: InferenceService,
    observed: Observed,
    previous: Mapping[str, Any] | None,
    *,
    generation: int | None,
    now: str,
    plan: RankPlan | None = None,
    live: Live | None = None,
    missing: Sequence[str] = (),
    grant: Grant | None = None,
    inference_pool: str | None = None,
) -> dict[str, Any]:
    """The whole status of a valid InferenceService whose children are `observed`.

    `plan` is what was applied (the spec's ranks unless the autoscaler or the health checks
    changed them); `live` is what the ranks' metrics said at the last scrape (None: no scrape
    yet, and the live fields are left as they are); `missing` names the children that should
    exist and do not (deleted behind the operator's back: being restored); `grant` is the
    placement in an AcceleratorPool, when the spec lists pools; `inference_pool` the state of the
    InferencePool the spec asks for (`inference_pool.CREATED`, `NOT_INSTALLED`; None: not asked).
    A field whose value is None is one to remove (`publish` sends it as null in the merge patch).
    """
    previous = previous or {}
    old_conditions = previous.get("conditions") or []
    spec = isvc.spec
    plan = plan or RankPlan.of(isvc)
    desired = live.desired if live is not None else plan.pods
    if grant is not None and grant.short:
        desired = max(desired, grant.wanted)  # what is wanted, not what the quota allows
    if observed.rank_sets:
        ranks = combined([rollout(sts, count) for sts, count in observed.rank_sets])
    else:
        ranks = rollout(observed.statefulset, plan.pods)
    router = (
        rollout(observed.router, router_replicas(isvc, observed.router))
        if spec.has_router
        else None
    )
    problems = pod_problems(observed.pods)
    url = naming.ingress_url(isvc, _load_balancer_address(observed.ingress))

    def cond(type_: str, status: bool, reason: str, message: str) -> dict[str, Any]:
        return condition(
            type_,
            status,
            reason,
            message,
            generation=generation,
            previous=old_conditions,
            now=now,
        )

    # A rank being drained is ready but no longer counts: at most every desired rank is ready.
    ready_ranks = min(ranks.ready, desired)
    rank_text = f"{ready_ranks}/{desired} ranks ready"
    router_text = f"router {router.ready}/{router.desired} ready" if router else "no router"
    summary = f"{rank_text}; {router_text}"

    if missing and observed.statefulset is not None:
        ready = cond(READY, False, "ChildrenMissing", "restoring " + ", ".join(missing))
    elif observed.statefulset is None:
        ready = cond(READY, False, "RanksNotReady", "the rank StatefulSet does not exist yet")
    elif not ranks.complete:
        reason = "RanksNotReady" if ranks.ready < ranks.desired else "RolloutInProgress"
        ready = cond(READY, False, reason, summary)
    elif router is not None and not router.complete:
        ready = cond(READY, False, "RouterNotReady", summary)
    elif grant is not None and grant.short:
        # Every granted rank serves; the rest wait for room in the pool.
        ready = cond(READY, plan.pods > 0, QUOTA_EXCEEDED, f"{summary}; {grant.limit}")
    elif plan.pods == 0:
        # Reconciled to what was asked for (kstatus: Current); Argo CD shows it Suspended.
        ready = cond(READY, True, "ScaledToZero", "spec.replicas is 0: no rank serves requests")
    else:
        ready = cond(
            READY, True, "Ready", f"{summary}; serving at {url or naming.cluster_url(isvc)}"
        )

    converged = ranks.complete and (router is None or router.complete)
    if missing:
        reconciling = cond(RECONCILING, True, "Restoring", "restoring " + ", ".join(missing))
    elif converged:
        reconciling = cond(RECONCILING, False, "Complete", summary)
    elif observed.statefulset is None or (ranks.current == 0 and ranks.desired > 0):
        reconciling = cond(RECONCILING, True, "Creating", summary)
    elif ranks.observed and ranks.revision_settled and ranks.current != ranks.desired:
        reconciling = cond(
            RECONCILING, True, "Scaling", f"{ranks.current} -> {ranks.desired} ranks"
        )
    elif not ranks.observed or not ranks.revision_settled or ranks.updated < ranks.desired:
        reconciling = cond(RECONCILING, True, "RollingUpdate", summary)
    else:
        reconciling = cond(RECONCILING, True, "Starting", summary)
    stalled_condition = cond(STALLED, False, "AsExpected", "every child was applied")

    stalled = list(live.stalled.values()) if live else []
    imbalance = live.imbalance if live else None
    if problems:
        degraded = cond(DEGRADED, True, "PodsFailing", "; ".join(problems + stalled))
    elif stalled:
        degraded = cond(
            DEGRADED,
            True,
            "SchedulerStalled",
            "; ".join(stalled) + "; withdrawn from routing until it recovers",
        )
    elif imbalance:
        degraded = cond(DEGRADED, True, "RankImbalance", imbalance)
    else:
        degraded = cond(DEGRADED, False, "AsExpected", "no failing pods, no stalled rank")

    ours = [ready, reconciling, stalled_condition, degraded]
    if inference_pool == "Created":
        ours.append(
            cond(INFERENCE_POOL, True, "Created", f"InferencePool {isvc.name} selects the ranks")
        )
    elif inference_pool is not None:
        ours.append(
            cond(
                INFERENCE_POOL,
                False,
                inference_pool,
                "the cluster does not serve inference.networking.k8s.io/v1 InferencePools (its "
                "CRD is not installed); serving through the Berth router",
            )
        )
    status: dict[str, Any] = {
        "conditions": _merge_conditions(ours, old_conditions),
        "url": url or naming.cluster_url(isvc),
        "clusterURL": naming.cluster_url(isvc),
        "replicas": ranks.current,
        "readyReplicas": ranks.ready,
        "desiredReplicas": desired,
        "readyRanks": f"{ready_ranks}/{desired}",
        "routerReadyReplicas": router.ready if router else 0,
        "selector": naming.label_selector(naming.selector_labels(isvc.name, c.ROLE_RANK)),
    }
    if grant is not None:
        status["pools"] = [{"pool": pool, "ranks": ranks} for pool, ranks in grant.pools]
    elif previous.get("pools"):
        status["pools"] = None  # no pools listed any more
    if live is not None:
        status.update(
            queuedRequests=live.queued,
            runningRequests=live.running,
            kvUsage=f"{live.kv_usage:.0%}" if live.kv_usage is not None else "",
            ranks=_rank_entries(live.ranks, previous.get("ranks"), now),
        )
        # None deletes it (merge patch): no autoscaler, no decision to show.
        autoscaler = dict(live.autoscaler) if live.autoscaler is not None else None
        if autoscaler is not None and grant is not None and grant.short:
            autoscaler.update(
                reason=QUOTA_EXCEEDED, message=f"held at {grant.ranks} ranks: {grant.limit}"
            )
        status["autoscaler"] = autoscaler
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def _rank_entries(
    ranks: Sequence[Mapping[str, Any]], previous: Any, now: str
) -> list[dict[str, Any]]:
    """The ranks' entries, written only when they change: a rank whose numbers did not change
    keeps its earlier lastScrape, and an Unreachable rank its earlier message (the error's
    wording may vary from one scrape to the next; that it does not answer does not)."""
    before = {
        entry.get("rank"): entry
        for entry in (previous if isinstance(previous, list) else [])
        if isinstance(entry, Mapping)
    }
    entries = []
    for entry in ranks:
        entry = dict(entry)
        old = before.get(entry["rank"])
        if old is not None:
            if entry.get("state") == old.get("state") == "Unreachable" and "message" in old:
                entry["message"] = old["message"]
            if "lastScrape" in entry and "lastScrape" in old:
                same = {k: v for k, v in old.items() if k != "lastScrape"} == {
                    k: v for k, v in entry.items() if k != "lastScrape"
                }
                if same and _seconds_between(old["lastScrape"], now) != float("inf"):
                    entry["lastScrape"] = old["lastScrape"]
        entries.append(entry)
    return entries


def _seconds_between(earlier: str, later: str) -> float:
    try:
        start = datetime.datetime.strptime(earlier, RFC3339)
        end = datetime.datetime.strptime(later, RFC3339)
    except (TypeError, ValueError):
        return float("inf")
    return (end - start).total_seconds()


def failed(
    reason: str,
    message: str,
    previous: Mapping[str, Any] | None,
    *,
    generation: int | None,
    now: str,
    retrying: bool = False,
) -> dict[str, Any]:
    """The status of a generation that could not be applied; running children stay as they are.

    `retrying`: the failure is the API server's (ApplyFailed), and the operator tries again
    with backoff: Reconciling. Otherwise it waits for someone to act (a new spec, a freed name,
    a granted permission): Stalled, which kstatus and Flux read as failed at once.
    """
    previous = dict(previous or {})
    old_conditions = previous.get("conditions") or []

    def cond(type_: str, status: bool, why: str, text: str) -> dict[str, Any]:
        return condition(
            type_, status, why, text, generation=generation, previous=old_conditions, now=now
        )

    if reason == INVALID_SPEC:
        next_step = "not applied; fix the spec"
    elif retrying:
        next_step = "not applied; retrying"
    else:
        next_step = "not applied; retried now and then until the cause is gone"
    ours = [
        cond(READY, False, reason, message),
        cond(RECONCILING, retrying, reason, next_step),
        cond(STALLED, not retrying, reason, message if not retrying else next_step),
        cond(DEGRADED, True, reason, message),
    ]
    previous["conditions"] = _merge_conditions(ours, old_conditions)
    if generation is not None:
        previous["observedGeneration"] = generation
    return previous


def _load_balancer_address(ingress: Mapping[str, Any] | None) -> str | None:
    if ingress is None:
        return None
    entries = ((ingress.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    for entry in entries:
        address = entry.get("hostname") or entry.get("ip")
        if address:
            return address
    return None


def _clip(message: str) -> str:
    return (
        message if len(message) <= MAX_MESSAGE_LENGTH else message[: MAX_MESSAGE_LENGTH - 3] + "..."
    )


async def publish(
    kube: Kube, namespace: str, name: str, current: Mapping[str, Any] | None, new: Mapping[str, Any]
) -> dict[str, Any] | None:
    """Write `new` over `current` as a merge patch of .status: the resource as stored afterwards,
    or None (and no request at all) when nothing changed."""
    patch = merge_patch(current or {}, new)
    if not patch:
        return None
    return await kube.patch_status(namespace, name, patch)


def merge_patch(current: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns the keys of `new` in `current` into `new`'s:
    nested objects are patched key by key (a key they lose is set to null, which deletes it);
    keys of `current` that `new` does not mention are left alone."""
    patch: dict[str, Any] = {}
    for key, value in new.items():
        old = current.get(key)
        if old == value:
            continue
        if isinstance(value, Mapping) and isinstance(old, Mapping):
            nested = merge_patch(old, value)
            nested.update({gone: None for gone in old if gone not in value})
            patch[key] = nested
        else:
            patch[key] = value
    return patch
