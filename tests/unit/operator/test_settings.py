"""kopf's settings: bookkeeping under our prefix, events for what matters, server-side watches."""

from __future__ import annotations

import logging

import kopf

from berth_operator import constants as c
from berth_operator.settings import apply_settings


def test_bookkeeping_goes_to_annotations_under_our_prefix() -> None:
    settings = kopf.OperatorSettings()
    apply_settings(settings)
    progress = settings.persistence.progress_storage
    diffbase = settings.persistence.diffbase_storage
    assert isinstance(progress, kopf.AnnotationsProgressStorage)
    assert isinstance(diffbase, kopf.AnnotationsDiffBaseStorage)
    assert progress.prefix == diffbase.prefix == c.ANNOTATION_PREFIX
    assert settings.posting.level == logging.WARNING
    assert settings.posting.reporting_component == c.MANAGED_BY


def test_child_watches_are_filtered_by_the_api_server() -> None:
    settings = kopf.OperatorSettings()
    apply_settings(settings)
    selectors = {
        (sel.group, sel.version, sel.any_name): value
        for sel, value in settings.watching.label_selectors.items()
    }
    managed = f"{c.LABEL_MANAGED_BY}={c.MANAGED_BY}"
    assert selectors == {
        ("apps", "v1", "statefulsets"): managed,
        ("apps", "v1", "deployments"): managed,
        ("networking.k8s.io", "v1", "ingresses"): managed,
        ("", "v1", "pods"): managed,
    }
    assert settings.watching.server_timeout and settings.watching.client_timeout
