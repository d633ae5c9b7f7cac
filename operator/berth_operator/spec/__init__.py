"""The InferenceService's spec, defined once: typed classes that parse a resource and generate the
CRD's schema (`berth_operator.crd`). Each module holds one part of the spec; this one names the
classes the rest of the operator uses."""

from berth_operator.spec.model import ModelSpec
from berth_operator.spec.placement import Parallelism, ResourcesSpec, SchedulingSpec
from berth_operator.spec.routing import IngressSpec, RoutingSpec
from berth_operator.spec.runtime import RuntimeArgs, RuntimeSpec
from berth_operator.spec.scaling import AutoscalingSpec, HealthSpec
from berth_operator.spec.secret_refs import (
    AdminApiKeySecretRef,
    ApiKeySecretRef,
    HfTokenSecretRef,
    SecretKeyRef,
)
from berth_operator.spec.service import InferenceService, InferenceServiceSpec, SpecError

__all__ = [
    "AdminApiKeySecretRef",
    "ApiKeySecretRef",
    "AutoscalingSpec",
    "HealthSpec",
    "HfTokenSecretRef",
    "InferenceService",
    "InferenceServiceSpec",
    "IngressSpec",
    "ModelSpec",
    "Parallelism",
    "ResourcesSpec",
    "RoutingSpec",
    "RuntimeArgs",
    "RuntimeSpec",
    "SchedulingSpec",
    "SecretKeyRef",
    "SpecError",
]
