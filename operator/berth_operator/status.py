"""The InferenceService's status: conditions, URL and rank counts from the children's real state.

The functions that compute a status are pure (the clock is an argument); `publish` is the only
writer of `.status` and writes nothing when nothing changed, so a resync is a no-op.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from berth_operator import builders
from berth_operator import constants as c
from berth_operator.spec import InferenceService

if TYPE_CHECKING:
    from berth_operator.k8s import Kube

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
CONDITION_TYPES = (READY, PROGRESSING, DEGRADED)

# Reasons that only a reconcile of a newer generation may clear (a resync must not paper over them).
INVALID_SPEC = "InvalidSpec"
APPLY_FAILED = "ApplyFailed"
STICKY_REASONS = (INVALID_SPEC, APPLY_FAILED)

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


@dataclass(frozen=True)
class Observed:
    """The children as last read from the API server (None: not found)."""

    statefulset: Mapping[str, Any] | None = None
    router: Mapping[str, Any] | None = None
    ingress: Mapping[str, Any] | None = None
    pods: Sequence[Mapping[str, Any]] = field(default_factory=tuple)


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
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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
    """Our three conditions first, then any other condition types left by other writers."""
    others = [dict(p) for p in previous if p.get("type") not in CONDITION_TYPES]
    return ours + others


def compute(
    isvc: InferenceService,
    observed: Observed,
    previous: Mapping[str, Any] | None,
    *,
    generation: int | None,
    now: str,
) -> dict[str, Any]:
    """The whole status of a valid InferenceService whose children are `observed`."""
    previous = previous or {}
    old_conditions = previous.get("conditions") or []
    spec = isvc.spec
    ranks = rollout(observed.statefulset, spec.ranks)
    router = rollout(observed.router, spec.routing.router_replicas) if spec.has_router else None
    problems = pod_problems(observed.pods)
    url = builders.ingress_url(isvc, _load_balancer_address(observed.ingress))

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

    rank_text = f"{ranks.ready}/{ranks.desired} ranks ready"
    router_text = f"router {router.ready}/{router.desired} ready" if router else "no router"
    summary = f"{rank_text}; {router_text}"

    if spec.ranks == 0:
        ready = cond(READY, False, "NoRanks", "spec.replicas is 0: no rank serves requests")
    elif observed.statefulset is None:
        ready = cond(READY, False, "RanksNotReady", "the rank StatefulSet does not exist yet")
    elif not ranks.complete:
        reason = "RanksNotReady" if ranks.ready < ranks.desired else "RolloutInProgress"
        ready = cond(READY, False, reason, summary)
    elif router is not None and not router.complete:
        ready = cond(READY, False, "RouterNotReady", summary)
    else:
        ready = cond(
            READY, True, "Ready", f"{summary}; serving at {url or builders.cluster_url(isvc)}"
        )

    converged = ranks.complete and (router is None or router.complete)
    if converged:
        progressing = cond(PROGRESSING, False, "Complete", summary)
    elif observed.statefulset is None or (ranks.current == 0 and ranks.desired > 0):
        progressing = cond(PROGRESSING, True, "Creating", summary)
    elif not ranks.observed or not ranks.revision_settled or ranks.updated < ranks.desired:
        progressing = cond(PROGRESSING, True, "RollingUpdate", summary)
    elif ranks.current != ranks.desired:
        progressing = cond(
            PROGRESSING, True, "Scaling", f"{ranks.current} -> {ranks.desired} ranks"
        )
    else:
        progressing = cond(PROGRESSING, True, "Starting", summary)

    if problems:
        degraded = cond(DEGRADED, True, "PodsFailing", "; ".join(problems))
    else:
        degraded = cond(DEGRADED, False, "AsExpected", "no failing pods")

    status: dict[str, Any] = {
        "conditions": _merge_conditions([ready, progressing, degraded], old_conditions),
        "url": url or builders.cluster_url(isvc),
        "clusterURL": builders.cluster_url(isvc),
        "replicas": ranks.current,
        "readyReplicas": ranks.ready,
        "desiredReplicas": ranks.desired,
        "readyRanks": f"{ranks.ready}/{ranks.desired}",
        "routerReadyReplicas": router.ready if router else 0,
        "selector": builders.label_selector(builders.selector_labels(isvc.name, c.ROLE_RANK)),
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def failed(
    reason: str,
    message: str,
    previous: Mapping[str, Any] | None,
    *,
    generation: int | None,
    now: str,
) -> dict[str, Any]:
    """The status of a generation that could not be applied; running children stay as they are."""
    previous = dict(previous or {})
    old_conditions = previous.get("conditions") or []
    ours = [
        condition(
            READY, False, reason, message, generation=generation, previous=old_conditions, now=now
        ),
        condition(
            PROGRESSING,
            False,
            reason,
            "not applied; fix the spec" if reason == INVALID_SPEC else "not applied; retrying",
            generation=generation,
            previous=old_conditions,
            now=now,
        ),
        condition(
            DEGRADED, True, reason, message, generation=generation, previous=old_conditions, now=now
        ),
    ]
    previous["conditions"] = _merge_conditions(ours, old_conditions)
    if generation is not None:
        previous["observedGeneration"] = generation
    return previous


def sticky_failure(status: Mapping[str, Any] | None, generation: int | None) -> bool:
    """Whether `status` reports that this very generation failed to apply."""
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == READY:
            return (
                cond.get("reason") in STICKY_REASONS
                and cond.get("observedGeneration") == generation
            )
    return False


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
) -> bool:
    """Write `new` over `current` as a merge patch of .status; False (and no request) if equal."""
    current = current or {}
    patch = {key: value for key, value in new.items() if current.get(key) != value}
    if not patch:
        return False
    await kube.patch_status(namespace, name, patch)
    return True
