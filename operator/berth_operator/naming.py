"""Names, labels and addresses of an InferenceService's children: what builders, status and
the worker agree on."""

from __future__ import annotations

from berth_operator import constants as c
from berth_operator.spec import InferenceService


def rank_statefulset_name(name: str, rank_set: int = 0) -> str:
    """The first rank set (the only one without pools) is named after the service; a service
    spread over AcceleratorPools has one more per further pool: <name>-s1, <name>-s2, ..."""
    return name if rank_set == 0 else f"{name}-s{rank_set}"


def headless_service_name(name: str) -> str:
    return f"{name}-ranks"


def rank_service_name(name: str, rank: int) -> str:
    return f"{name}-rank-{rank}"


def rank_pod_name(name: str, rank: int) -> str:
    return f"{name}-{rank}"


def router_name(name: str) -> str:
    """The router's Deployment, PodDisruptionBudget, ServiceAccount and RoleBinding."""
    return f"{name}-router"


def entry_service_name(name: str) -> str:
    return name


def selector_labels(name: str, role: str) -> dict[str, str]:
    """Labels that select one role's pods; they never change for the life of the resource."""
    return {c.LABEL_ISVC: name, c.LABEL_ROLE: role}


def owned_labels(name: str) -> dict[str, str]:
    """Labels on every child: what `prune` lists to find the children of one InferenceService."""
    return {c.LABEL_ISVC: name, c.LABEL_MANAGED_BY: c.MANAGED_BY}


def labels(name: str, role: str | None = None) -> dict[str, str]:
    """Every child's labels. No `app.kubernetes.io/instance`: GitOps tools read that one as
    ownership (Argo CD's default tracking label) and would prune the children."""
    result = {
        c.LABEL_NAME: c.APP_NAME,
        c.LABEL_PART_OF: c.APP_NAME,
        **owned_labels(name),
    }
    if role is not None:
        result[c.LABEL_COMPONENT] = role
        result[c.LABEL_ROLE] = role
    return result


def label_selector(selector: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


def service_url(isvc: InferenceService, service: str, port: int) -> str:
    return f"http://{service}.{isvc.namespace}.svc:{port}"


def rank_endpoints_selector(name: str) -> str:
    """Selects the EndpointSlices of the per-rank Services (not the headless one's): the
    EndpointSlice controller copies each Service's labels, the rank label included."""
    return f"{c.LABEL_ISVC}={name},{c.LABEL_DP_RANK}"


def cluster_url(isvc: InferenceService) -> str:
    """The in-cluster OpenAI base URL (the entry Service, port 80)."""
    return f"http://{entry_service_name(isvc.name)}.{isvc.namespace}.svc/v1"


def ingress_url(isvc: InferenceService, load_balancer_address: str | None = None) -> str | None:
    """The public OpenAI base URL, when the Ingress has a host or has been given an address."""
    ingress = isvc.spec.ingress
    if ingress is None:
        return None
    host = ingress.host or load_balancer_address
    if not host or host.startswith("*"):
        return None
    scheme = "https" if ingress.tls is not None else "http"
    return f"{scheme}://{host}{ingress.path.rstrip('/')}/v1"
