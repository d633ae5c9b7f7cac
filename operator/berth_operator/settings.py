"""Operator start-up: kopf's settings (events, timeouts, server-side watch filters), the client."""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf

from berth_operator import constants as c
from berth_operator import pools
from berth_operator.k8s import Kube

# Every kind the operator watches besides InferenceServices: its children and their pods.
CHILD_RESOURCES = (
    ("apps", "v1", "statefulsets"),
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("networking.k8s.io", "v1", "ingresses"),
    ("", "v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("", "v1", "pods"),
)

# What pools are placed and reported from (all read, none written but the pools' status).
POOL_INPUTS = (
    (c.GROUP, c.VERSION, c.POOL_PLURAL),
    ("", "v1", "nodes"),
    ("", "v1", "namespaces"),
)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    apply_settings(settings)
    # Tests and `--dev` may hand in their own connection; otherwise the pod's service account
    # (or the local kubeconfig) is used.
    if getattr(memo, "kube", None) is None:
        memo.kube = Kube.from_environment()
    if getattr(memo, "default_image", None) is None:
        memo.default_image = c.DEFAULT_RUNTIME_IMAGE
    if getattr(memo, "router_image", None) is None:
        memo.router_image = c.DEFAULT_ROUTER_IMAGE
    if getattr(memo, "observe_interval", None) is None:
        memo.observe_interval = c.OBSERVE_INTERVAL_SECONDS
    memo.workers = {}
    pools.set_up(memo)


def apply_settings(settings: kopf.OperatorSettings) -> None:
    # Events for what users must act on (invalid specs, failures), not for every log line.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = c.MANAGED_BY
    settings.posting.reporting_instance = os.environ.get("HOSTNAME", "local")
    settings.posting.event_name_prefix = "berth-"
    # Watches that die silently (load balancers, API server restarts) are renewed.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    # Watch only our own children, filtered by the API server (pods above all: there are many).
    managed = f"{c.LABEL_MANAGED_BY}={c.MANAGED_BY}"
    for group, version, plural in CHILD_RESOURCES:
        settings.watching.label_selectors[group, version, plural] = managed
