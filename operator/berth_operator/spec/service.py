"""InferenceService: the typed, defaulted, validated view of a resource; SpecError says what to fix.

The CRD (generated from these classes, see `berth_operator.crd`) makes the API server reject most
bad input. Reading a spec checks the same constraints again (`berth operator render` reads files
no API server has seen, and an object stored under an older CRD may break a newer rule) plus what
only the operator knows (what the runtime supports, which flags it owns, names the API server would
refuse only on a child), and applies the same defaults as the CRD, so that a spec read straight
from a file renders exactly like the stored one. What neither can see (a misspelt key inside a
pass-through field such as `affinity`) the API server finds when the children are applied
strictly.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from berth_operator import constants
from berth_operator.spec.fields import (
    Object,
    Report,
    Rule,
    array,
    integer,
    obj,
    optional,
    read_object,
    spec_object,
)
from berth_operator.spec.formats import DNS1035_LABEL
from berth_operator.spec.model import ModelSpec
from berth_operator.spec.placement import Parallelism, PoolRef, ResourcesSpec, SchedulingSpec
from berth_operator.spec.routing import IngressSpec, RoutingSpec
from berth_operator.spec.runtime import RuntimeSpec
from berth_operator.spec.scaling import MAX_REPLICAS, AutoscalingSpec, HealthSpec
from berth_operator.spec.secret_refs import AdminApiKeySecretRef, ApiKeySecretRef

# The longest child name is "<name>-rank-<63>"; the StatefulSet's controller-revision-hash label
# ("<name>-<10 chars>") must fit in 63 characters too.
MAX_NAME_LENGTH = 45
# The same rules on metadata.name, run by the API server at admission.
NAME_RULES = (
    Rule(
        f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
        f"metadata.name must be at most {MAX_NAME_LENGTH} characters (child names such as "
        "<name>-rank-<N> must fit in 63)",
    ),
    Rule(
        f"self.metadata.name.matches('{DNS1035_LABEL}')",
        "metadata.name must start with a letter and contain only lowercase letters, digits and "
        "'-' (it names Services)",
    ),
)


class SpecError(ValueError):
    """The spec cannot be turned into workloads; the message names each field and what to fix."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


@spec_object(
    "What to serve and how. Every field has a default; an empty spec serves the embedded model "
    "on CPU.",
    rules=(
        Rule(
            "!has(self.resources) || !has(self.parallelism) || self.resources.gpus == 0 "
            "|| self.resources.gpus >= self.parallelism.tensor",
            "resources.gpus must be at least parallelism.tensor (or 0 for CPU)",
        ),
        Rule(
            "!has(self.runtime) || !has(self.runtime.args) || !has(self.runtime.args.device) "
            "|| self.runtime.args.device != 'cuda' "
            "|| (has(self.resources) && self.resources.gpus > 0) "
            "|| (has(self.parallelism) && self.parallelism.tensor > 1) "
            "|| (has(self.pools) && size(self.pools) > 0)",
            "runtime.args.device cuda needs resources.gpus of at least 1 (or pools)",
        ),
        Rule(
            "!has(self.pools) || size(self.pools) == 0 || !has(self.resources) "
            "|| !has(self.resources.gpus) || self.resources.gpus == 0",
            "with pools, each pool decides the accelerators: leave resources.gpus unset and use "
            "pools[].acceleratorsPerRank",
        ),
    ),
)
@dataclass(frozen=True)
class InferenceServiceSpec:
    model: ModelSpec = obj(ModelSpec, schema_default=True)
    runtime: RuntimeSpec = obj(RuntimeSpec, schema_default=True)
    resources: ResourcesSpec = obj(ResourcesSpec, schema_default=True)
    parallelism: Parallelism = obj(Parallelism, schema_default=True)
    replicas: int = integer(
        "Data-parallel ranks: one pod each, with a stable rank (pod ordinal). This is the field "
        "`kubectl scale` and HPA/KEDA (through the scale subresource) change. With autoscaling "
        "enabled it is only the starting count: the operator's autoscaler decides from then on "
        "(status.desiredReplicas), within the autoscaling bounds.",
        1,
        minimum=0,
        maximum=MAX_REPLICAS,
    )
    autoscaling: AutoscalingSpec = obj(AutoscalingSpec, schema_default=True)
    health: HealthSpec = obj(HealthSpec, schema_default=True)
    routing: RoutingSpec = obj(RoutingSpec, schema_default=True)
    ingress: IngressSpec | None = optional(IngressSpec)
    api_key: ApiKeySecretRef | None = optional(ApiKeySecretRef, json="apiKeySecretRef")
    admin_api_key: AdminApiKeySecretRef | None = optional(
        AdminApiKeySecretRef, json="adminApiKeySecretRef"
    )
    scheduling: SchedulingSpec = obj(SchedulingSpec)
    pools: tuple[PoolRef, ...] = array(
        "AcceleratorPools to run the ranks in, in order of preference (e.g. H100, else L4): ranks "
        "go to the first pool this namespace may use that has room under its limits, the rest to "
        "the next; running ranks stay where they are. A pool sets the accelerator, placement and "
        "defaults; what this spec sets wins unless the pool locks it.",
        Object(PoolRef),
        max_items=8,
        map_keys=("name",),
    )

    @property
    def ranks(self) -> int:
        """How many DP ranks to run: `replicas`, kept within the autoscaling bounds when enabled."""
        if not self.autoscaling.enabled:
            return self.replicas
        return min(max(self.replicas, self.autoscaling.min_replicas), self.autoscaling.max_replicas)

    @property
    def rank_gpus(self) -> int:
        """GPUs each rank pod requests: resources.gpus, or parallelism.tensor (one GPU per
        tensor-parallel process) when that is above 1 and no count is given, unless the runtime
        is told to run on the CPU (`runtime.args.device: cpu`). With pools, the pool decides."""
        gpus, tensor = self.resources.gpus, self.parallelism.tensor
        if gpus or tensor == 1 or self.pools or self.runtime.args.device == "cpu":
            return gpus
        return tensor

    @property
    def has_router(self) -> bool:
        return self.routing.router_replicas > 0

    def check(self, report: Report) -> None:
        tensor, gpus = self.parallelism.tensor, self.resources.gpus
        if gpus and gpus < tensor:
            report(
                "resources.gpus",
                f"{gpus} GPUs cannot hold parallelism.tensor={tensor}; "
                "request at least as many GPUs as tensor-parallel ranks",
            )
        if self.pools and gpus:
            report(
                "resources.gpus",
                "with pools, each pool decides the accelerators: leave it unset and use "
                "pools[].acceleratorsPerRank",
            )
        if self.runtime.args.device == "cuda" and self.rank_gpus == 0 and not self.pools:
            report(
                "runtime.args.device",
                "cuda needs GPUs: set resources.gpus to at least 1, or use device auto or cpu",
            )

    @classmethod
    def from_spec(
        cls, spec: Mapping[str, Any] | None, *, default_image: str | None = None
    ) -> InferenceServiceSpec:
        """Parse `.spec`; raise SpecError listing every problem found. `default_image` is the
        runtime image for a spec that names none (the operator's --runtime-image)."""
        problems: list[str] = []
        parsed = read_object(cls, spec, "spec", problems)
        if problems or parsed is None:
            raise SpecError(problems)
        runtime = (spec or {}).get("runtime")
        if default_image and not (isinstance(runtime, Mapping) and runtime.get("image")):
            image = dataclasses.replace(parsed.runtime, image=default_image)
            parsed = dataclasses.replace(parsed, runtime=image)
        return parsed


@dataclass(frozen=True)
class InferenceService:
    """One InferenceService resource: its identity, the parsed spec, and the router image the
    operator runs in front of its ranks (the operator's --router-image; not part of the spec)."""

    name: str
    namespace: str
    spec: InferenceServiceSpec
    uid: str | None = None
    generation: int | None = None
    router_image: str = constants.DEFAULT_ROUTER_IMAGE

    @classmethod
    def from_body(
        cls,
        body: Mapping[str, Any],
        *,
        default_image: str | None = None,
        router_image: str = constants.DEFAULT_ROUTER_IMAGE,
    ) -> InferenceService:
        """Parse a whole resource (as stored, or as written in a file)."""
        problems: list[str] = []
        if body.get("apiVersion") not in (None, constants.API_VERSION):
            problems.append(
                f"apiVersion: expected {constants.API_VERSION}, got {body.get('apiVersion')!r}"
            )
        if body.get("kind") not in (None, constants.KIND):
            problems.append(f"kind: expected {constants.KIND}, got {body.get('kind')!r}")
        meta = body.get("metadata") or {}
        name = meta.get("name") if isinstance(meta, Mapping) else None
        namespace = (meta.get("namespace") if isinstance(meta, Mapping) else None) or "default"
        problems.extend(name_problems(name))
        try:
            spec = InferenceServiceSpec.from_spec(body.get("spec"), default_image=default_image)
        except SpecError as e:
            problems.extend(e.problems)
        if problems:
            raise SpecError(problems)
        return cls(
            name=name,
            namespace=namespace,
            spec=spec,
            uid=meta.get("uid"),
            generation=meta.get("generation"),
            router_image=router_image,
        )


def name_problems(name: object) -> list[str]:
    """Child names are built from the resource's name, so it must be a short DNS-1035 label."""
    if not isinstance(name, str) or not name:
        return ["metadata.name: required"]
    problems = []
    if len(name) > MAX_NAME_LENGTH:
        problems.append(
            f"metadata.name: {name!r} is {len(name)} characters; at most {MAX_NAME_LENGTH} "
            "(child names such as <name>-rank-<N> must stay within 63)"
        )
    if not re.match(DNS1035_LABEL, name):
        problems.append(
            f"metadata.name: {name!r} must be lowercase letters, digits and '-', start with a "
            "letter and end with a letter or digit (it names Services)"
        )
    return problems
