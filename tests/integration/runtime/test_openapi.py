"""The server against its own OpenAPI document: schemathesis, seeded, with its checks.

A real `berth serve` (a 96-token context, so that every generated request ends quickly) with a
serving and an admin key; schemathesis sends what the document allows and what it forbids, and
checks every answer: no 5xx, only documented statuses, content types and headers, bodies that
match their schemas, invalid input refused (`negative_data_rejection`), and the rest of its
checks. One check is left out, `positive_data_acceptance`: some rules span fields (exactly one of
`text` and `input_ids`, `best_of` equal to `n`, `logprob_start_len` inside the prompt, token ids
inside the vocabulary) or live in fields the server ignores (integers beyond 64 bits), which a
JSON schema cannot say; such a request gets a 400 naming the field, which the document lists.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.helpers import RunningServer
from tests.schemathesis_run import run_schemathesis

ADMIN_KEY = "openapi-admin"
SERVING_KEY = "openapi-serve"
EXAMPLES = 12
SEED = 1


# A few hundred requests, some generating: minutes on two busy cores.
@pytest.mark.timeout(900)
def test_the_server_keeps_to_its_openapi_document(tmp_path: Path) -> None:
    server = RunningServer(
        "--context-length", "96", "--api-key", SERVING_KEY, "--admin-api-key", ADMIN_KEY
    ).wait_ready()
    try:
        result = run_schemathesis(server.base_url, ADMIN_KEY, EXAMPLES, SEED, tmp_path)
        assert result.ok, result.report
        # ... and the server is still well afterwards.
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    finally:
        assert server.stop() == 0
