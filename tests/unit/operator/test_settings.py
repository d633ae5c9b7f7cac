"""kopf's settings and handlers: no state of kopf's on the objects, server-side watch filters."""

from __future__ import annotations

import logging

import kopf
from kopf._core.intents import registries

import berth_operator.handlers  # noqa: F401  (registers the handlers)
from berth_operator import constants as c
from berth_operator.settings import CHILD_RESOURCES, POOL_INPUTS, apply_settings


def test_every_handler_only_watches_so_kopf_keeps_no_state_on_the_objects() -> None:
    registry = registries.get_default_registry()
    # Changing and spawning handlers (on.create/update/resume, timers, daemons) make kopf store
    # progress and a diff base in annotations, and finalizers: there are none.
    assert registry._changing.get_all_handlers() == []
    assert registry._spawning.get_all_handlers() == []
    watched = {
        (h.selector.group or "", h.selector.version, h.selector.any_name)
        for h in registry._watching.get_all_handlers()
    }
    assert watched == {(c.GROUP, c.VERSION, c.PLURAL), *CHILD_RESOURCES, *POOL_INPUTS}
    # Indexed: kopf starts no handler before these kinds are fully listed.
    indexed = {
        (h.selector.group or "", h.selector.version, h.selector.any_name)
        for h in registry._indexing.get_all_handlers()
    }
    assert indexed == {*CHILD_RESOURCES, *POOL_INPUTS}


def test_events_for_what_matters_under_our_name() -> None:
    settings = kopf.OperatorSettings()
    apply_settings(settings)
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
    assert selectors == dict.fromkeys(CHILD_RESOURCES, managed)
    assert ("", "v1", "pods") in selectors
    assert settings.watching.server_timeout and settings.watching.client_timeout
