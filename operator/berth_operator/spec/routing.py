"""How requests reach the ranks: the router in front of them, the Ingress in front of that, and
an InferencePool for a Gateway API inference gateway."""

from __future__ import annotations

from dataclasses import dataclass

from berth_operator.spec.fields import (
    Report,
    Rule,
    enum,
    integer,
    optional,
    spec_object,
    string,
    string_map,
)
from berth_operator.spec.formats import (
    DNS1035_LABEL,
    DNS1123_SUBDOMAIN,
    WILDCARD_DNS1123_SUBDOMAIN,
)

ROUTING_POLICIES = ("cacheAware", "leastLoad", "roundRobin")
PATH_TYPES = ("Prefix", "Exact", "ImplementationSpecific")
MAX_ROUTER_REPLICAS = 16
FAILURE_MODES = ("FailClose", "FailOpen")


@spec_object("The endpoint picker (EPP) Service that the gateway asks which rank takes a request.")
@dataclass(frozen=True)
class EndpointPickerSpec:
    name: str = string(
        "The endpoint picker's Service, in the InferenceService's namespace.",
        required="required when endpointPicker is set",
        max_length=63,
        operator_pattern=DNS1035_LABEL,
        what="a Service name",
    )
    port: int = integer(
        "The Service's port of the picker's gRPC ext-proc server.",
        9002,
        minimum=1,
        maximum=65535,
    )
    failure_mode: str = enum(
        "What the gateway does when the picker does not answer: FailClose (refuse the request) or "
        "FailOpen (send it to any rank).",
        FAILURE_MODES,
        "FailClose",
    )


@spec_object(
    "Create an InferencePool (inference.networking.k8s.io/v1) of the ranks, for a Gateway API "
    "inference gateway (created when this is set; where the CRD is not installed, a condition "
    "says so and the router serves as before)."
)
@dataclass(frozen=True)
class InferencePoolSpec:
    endpoint_picker: EndpointPickerSpec | None = optional(EndpointPickerSpec)


@spec_object("The router in front of the ranks (the InferenceService's single entry point).")
@dataclass(frozen=True)
class RoutingSpec:
    policy: str = enum(
        "How the router picks a rank: cacheAware (the rank that already holds the prompt's prefix "
        "unless it is overloaded), leastLoad, or roundRobin.",
        ROUTING_POLICIES,
        "cacheAware",
    )
    router_replicas: int = integer(
        "Router pods. 0 runs no router; the entry Service then spreads requests over the ranks "
        "directly.",
        1,
        minimum=0,
        maximum=MAX_ROUTER_REPLICAS,
    )
    inference_pool: InferencePoolSpec | None = optional(InferencePoolSpec)


@spec_object("Serve HTTPS with the certificate in a Secret.")
@dataclass(frozen=True)
class IngressTLS:
    secret_name: str = string(
        "A kubernetes.io/tls Secret for the host.",
        required="required when tls is set",
        max_length=253,
        operator_pattern=DNS1123_SUBDOMAIN,
        what="a Secret name",
    )


@spec_object(
    "Expose the service outside the cluster through an Ingress (created when this is set).",
    rules=(Rule("!has(self.tls) || has(self.host)", "ingress.tls needs ingress.host"),),
)
@dataclass(frozen=True)
class IngressSpec:
    host: str | None = string(
        "Host name to serve (default any host).",
        max_length=253,
        operator_pattern=WILDCARD_DNS1123_SUBDOMAIN,
        what="a DNS name",
    )
    path: str = string(
        "URL path prefix. Paths other than / need a rewrite annotation for your controller.",
        "/",
        max_length=512,
        pattern=r"^/[^\s]*$",
        what="an absolute URL path",
        # The operator has always refused paths over 253 characters (the CRD allows 512).
        operator_max_length=253,
    )
    path_type: str = enum("How the path matches.", PATH_TYPES, "Prefix")
    class_name: str | None = string(
        "IngressClass to use (default the cluster's default class).",
        max_length=253,
        operator_pattern=DNS1123_SUBDOMAIN,
        what="an IngressClass name",
    )
    annotations: tuple[tuple[str, str], ...] = string_map(
        "Annotations for the Ingress, e.g. timeouts long enough for streaming."
    )
    tls: IngressTLS | None = optional(IngressTLS)

    def check(self, report: Report) -> None:
        if self.tls and not self.host:
            report("tls", "needs ingress.host: a certificate is issued for a host name")
