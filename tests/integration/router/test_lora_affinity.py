"""LoRA adapter affinity through a real `berth router`: two real LoRA ranks, an adapter loaded on
one of them at run time; requests for the adapter all reach that rank, base requests spread over
both, and an adapter unloaded everywhere is the rank's own 404."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import RunningServer, embedded_model_dir, running_servers, wait_for
from tests.integration.router.conftest import RunningRouter
from tests.lora_adapters import make_adapter


@pytest.fixture(scope="module")
def lora_ranks() -> Iterator[list[RunningServer]]:
    args = [
        ["--model", embedded_model_dir(), "--dp-rank", str(i), "--enable-lora"] for i in range(2)
    ]
    with running_servers(args) as servers:
        yield servers


@pytest.fixture(scope="module")
def lora_router(lora_ranks: list[RunningServer]) -> Iterator[RunningRouter]:
    srv = RunningRouter(
        "--worker-urls",
        *(r.base_url for r in lora_ranks),
        "--health-check-interval",
        "0.5",
        "--policy",
        "round_robin",
    ).wait_ready()
    yield srv
    srv.stop()


def completion(router: RunningRouter, model: str | None) -> httpx.Response:
    body: dict = {"prompt": "The sea is", "max_tokens": 4, "temperature": 0}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{router.base_url}/v1/completions", json=body, timeout=120)


def test_requests_for_an_adapter_go_to_the_rank_that_serves_it(
    lora_ranks: list[RunningServer], lora_router: RunningRouter, tmp_path: Path
) -> None:
    adapter = make_adapter(tmp_path / "a1", seed=1)
    loaded = httpx.post(
        f"{lora_ranks[1].base_url}/load_lora_adapter",
        json={"lora_name": "a1", "lora_path": str(adapter)},
        timeout=60,
    )
    assert loaded.status_code == 200, loaded.text
    # The router learns it from the rank's /get_load.
    wait_for(
        lambda: "a1" in (lora_router.workers()[1].get("rank_load") or {}).get("lora_adapters", []),
        timeout=30,
        what="the router to see a1 on rank 1",
    )
    ranks = []
    for _ in range(6):
        response = completion(lora_router, "a1")
        assert response.status_code == 200, response.text
        ranks.append(int(response.headers["x-data-parallel-rank"]))
    assert ranks == [1] * 6  # round_robin alone would alternate
    base = {int(completion(lora_router, None).headers["x-data-parallel-rank"]) for _ in range(4)}
    assert base == {0, 1}
    metrics = httpx.get(f"{lora_router.base_url}/metrics", timeout=10).text
    assert 'berth:router_lora_affinity_total{decision="lora_' in metrics
    # Unloaded everywhere: nothing serves it, and the rank the request lands on says so.
    unloaded = httpx.post(
        f"{lora_ranks[1].base_url}/unload_lora_adapter", json={"lora_name": "a1"}, timeout=60
    )
    assert unloaded.status_code == 200
    gone = completion(lora_router, "a1")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
