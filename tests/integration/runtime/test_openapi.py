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

import subprocess
import sys
from pathlib import Path

import httpx

from tests.helpers import RunningServer

ADMIN_KEY = "openapi-admin"
EXAMPLES = 12
SEED = 1


def test_the_server_keeps_to_its_openapi_document(tmp_path: Path) -> None:
    server = RunningServer(
        "--context-length", "96", "--api-key", "openapi-serve", "--admin-api-key", ADMIN_KEY
    ).wait_ready()
    try:
        st = Path(sys.executable).with_name("st")
        result = subprocess.run(
            [
                str(st),
                "run",
                f"{server.base_url}/openapi.json",
                "--checks",
                "all",
                "--exclude-checks",
                "positive_data_acceptance",
                "--max-response-time",  # speed is the benchmarks' business, not a busy CI's
                "600",
                "--max-examples",
                str(EXAMPLES),
                "--seed",
                str(SEED),
                "--header",
                f"Authorization: Bearer {ADMIN_KEY}",
                "--request-timeout",
                "60",
                "--generation-database",
                "none",
                "--no-color",
                "--warnings",
                "off",
            ],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
        assert "failures" not in result.stdout.splitlines()[-1], result.stdout[-5000:]
        # ... and the server is still well afterwards.
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    finally:
        assert server.stop() == 0
