"""The router against its own OpenAPI document: schemathesis, seeded, with its checks.

A real `berth router` in front of one real `berth serve` (a 96-token context, so that every
generated request ends quickly), both with a serving and an admin key. The router's document
describes its own routes (probes, `/workers`, `/flush_cache`) and the generation routes it
forwards, with the rank's answers and its own (502, 503, 504); schemathesis checks every answer
against it (`tests/schemathesis_run.py` says which check is left out and why).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.helpers import RunningServer
from tests.integration.router.conftest import RunningRouter
from tests.schemathesis_run import run_schemathesis

ADMIN_KEY = "router-openapi-admin"
SERVING_KEY = "router-openapi-serve"
EXAMPLES = 8
SEED = 1


# A few hundred requests, some generating: minutes on two busy cores.
@pytest.mark.timeout(900)
def test_the_router_keeps_to_its_openapi_document(tmp_path: Path) -> None:
    keys = ("--api-key", SERVING_KEY, "--admin-api-key", ADMIN_KEY)
    rank = RunningServer("--context-length", "96", *keys).wait_ready()
    router = None
    try:
        router = RunningRouter("--worker-urls", rank.base_url, *keys).wait_ready()
        result = run_schemathesis(router.base_url, ADMIN_KEY, EXAMPLES, SEED, tmp_path)
        assert result.ok, result.report
        # ... and both are still well afterwards.
        assert httpx.get(f"{router.base_url}/readiness", timeout=10).status_code == 200
        assert httpx.get(f"{rank.base_url}/health", timeout=10).status_code == 200
    finally:
        if router is not None:
            assert router.stop() == 0
        assert rank.stop() == 0
