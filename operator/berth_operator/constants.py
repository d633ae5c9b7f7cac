"""Names the operator and the cluster share: API group, labels, ports, paths, field manager."""

from __future__ import annotations

from typing import Final

from berth_operator import __version__

GROUP: Final = "serving.berth.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "InferenceService"
PLURAL: Final = "inferenceservices"
SINGULAR: Final = "inferenceservice"
SHORT_NAMES: Final = ("bis",)
# Cluster-scoped, written by cluster admins: where ranks run and how much each namespace may take.
POOL_KIND: Final = "AcceleratorPool"
POOL_PLURAL: Final = "acceleratorpools"
POOL_SINGULAR: Final = "acceleratorpool"
POOL_SHORT_NAMES: Final = ("bap",)

# Server-side apply: one field manager for every child the operator owns.
FIELD_MANAGER: Final = "berth-operator"
# The ClusterRole (shipped in manifests/rbac/) that each router's RoleBinding grants in its own
# namespace: list and watch EndpointSlices. The operator may bind this one role and no other.
ROUTER_CLUSTER_ROLE: Final = "berth-router"

DEFAULT_RUNTIME_IMAGE: Final = f"ghcr.io/berth-dev/berth-runtime:{__version__}"
# Routers run their own image (the Dockerfile's router stage): no torch, no model.
DEFAULT_ROUTER_IMAGE: Final = f"ghcr.io/berth-dev/berth-router:{__version__}"
OPERATOR_IMAGE: Final = f"ghcr.io/berth-dev/berth-operator:{__version__}"

# Labels on every child. The selector labels never change for the life of an InferenceService.
# No `app.kubernetes.io/instance`: Argo CD's default tracking label, which it would read as
# "belongs to the Application of that name" and prune.
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_PART_OF: Final = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_VERSION: Final = "app.kubernetes.io/version"
LABEL_ISVC: Final = f"{GROUP}/inferenceservice"
LABEL_ROLE: Final = f"{GROUP}/component"
# On each per-rank Service (and so on its EndpointSlices, which copy the Service's labels): the
# DP rank it fronts. `berth router` discovers the ranks by it.
LABEL_DP_RANK: Final = f"{GROUP}/dp-rank"
# On the rank StatefulSet and its pods: the AcceleratorPool the ranks run in, and how many of
# its accelerators each rank claims (the operator's quota ledger reads both back).
LABEL_POOL: Final = f"{GROUP}/pool"
ANNOTATION_PER_RANK: Final = f"{GROUP}/accelerators-per-rank"
# On the pods (and in the selector) of a service's second and later rank sets, one per pool.
LABEL_RANK_SET: Final = f"{GROUP}/rank-set"
# llm-d's endpoint picker reads this to pick the metric names of the engine (sglang:*).
LABEL_ENGINE_TYPE: Final = "llm-d.ai/engine-type"
ENGINE_TYPE: Final = "sglang"
APP_NAME: Final = "berth"
MANAGED_BY: Final = "berth-operator"
ROLE_RANK: Final = "rank"
ROLE_ROUTER: Final = "router"

# Set by the StatefulSet controller on each pod (Kubernetes >= 1.28): the pod's ordinal = DP rank.
POD_INDEX_LABEL: Final = "apps.kubernetes.io/pod-index"
POD_NAME_LABEL: Final = "statefulset.kubernetes.io/pod-name"

# Ports and paths inside the pods.
HTTP_PORT: Final = 8000
SERVICE_PORT: Final = 80
HEALTH_PATH: Final = "/health"
ROUTER_READINESS_PATH: Final = "/readiness"
ROUTER_LIVENESS_PATH: Final = "/liveness"
METRICS_PATH: Final = "/metrics"
LOAD_PATH: Final = "/get_load"
MODELS_MOUNT: Final = "/mnt/models"
CACHE_MOUNT: Final = "/var/cache/berth"
TMP_MOUNT: Final = "/tmp"
SHM_MOUNT: Final = "/dev/shm"
# The API keys, from their Secrets, as files (read once by the runtime and the router at start).
KEYS_MOUNT: Final = "/etc/berth/keys"

# The images' non-root user (see the Dockerfile).
RUN_AS_UID: Final = 10001

# How often each InferenceService's ranks are scraped (`berth operator run --observe-interval`).
OBSERVE_INTERVAL_SECONDS: Final = 5.0
# Children are re-applied on every change the watches report (drift repair); this full resync
# is the safety net for a change missed while a watch reconnected.
RESYNC_SECONDS: Final = 600.0

ENV_API_KEY: Final = "BERTH_API_KEY"
ENV_ADMIN_API_KEY: Final = "BERTH_ADMIN_API_KEY"
ENV_DP_RANK: Final = "BERTH_DP_RANK"
