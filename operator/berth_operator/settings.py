"""Operator start-up: kopf's settings (storage, timeouts, events, watches) and the API client."""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf

from berth_operator import constants as c
from berth_operator.k8s import Kube


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    apply_settings(settings)
    # Tests and `--dev` may hand in their own connection; otherwise the pod's service account
    # (or the local kubeconfig) is used.
    if getattr(memo, "kube", None) is None:
        memo.kube = Kube.from_environment()
    if getattr(memo, "default_image", None) is None:
        memo.default_image = c.DEFAULT_RUNTIME_IMAGE
    if getattr(memo, "observe_interval", None) is None:
        memo.observe_interval = c.OBSERVE_INTERVAL_SECONDS
    memo.services = {}


def apply_settings(settings: kopf.OperatorSettings) -> None:
    # kopf's bookkeeping goes into annotations under our own prefix: `.status` holds only what
    # users read, and the structural schema would prune kopf's fields from it anyway.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=c.ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=c.ANNOTATION_PREFIX, key="last-handled-configuration"
    )
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
    for resource in (
        ("apps", "v1", "statefulsets"),
        ("apps", "v1", "deployments"),
        ("networking.k8s.io", "v1", "ingresses"),
        ("v1", "pods"),
    ):
        settings.watching.label_selectors[resource] = managed
