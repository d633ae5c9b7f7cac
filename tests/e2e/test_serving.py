"""Install and serve on a real node: the CPU sample with two ranks and the router, a chat answer
through the router's Service with the OpenAI SDK, Berth's CPU kernels loaded in the image, the
router spreading over both ranks, the operator scraping both over the pod network, and a rank pod
deleted mid-stream finishing its stream (preStop, then the engine's drain) before it goes."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.samples import NAME, PROMPT, cpu_sample, finished_requests, serving

# A real cluster is slow: the first test also waits for the node, its image imports and the install.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def namespace(installed: Cluster) -> Iterator[str]:
    """The CPU sample as shipped (two ranks, one router), with small CPU requests; Ready."""
    with serving(installed, cpu_sample(replicas=2)) as name:
        yield name


def test_the_sample_serves_through_the_router_with_the_cpu_kernels(
    installed: Cluster, namespace: str
) -> None:
    isvc = installed.get("inferenceservice", NAME, "-n", namespace)
    assert isvc["status"]["readyRanks"] == "2/2"
    assert isvc["status"]["url"] == f"http://{NAME}.{namespace}.svc/v1"
    router = installed.get("deployment", f"{NAME}-router", "-n", namespace)
    assert router["status"]["readyReplicas"] == 1

    with installed.port_forward(namespace, f"svc/{NAME}", 80) as url:  # the router's Service
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model=NAME, messages=PROMPT, max_tokens=16, temperature=0
        )
    assert "Paris" in (reply.choices[0].message.content or "")

    for rank in (0, 1):
        log = installed.kubectl("-n", namespace, "logs", f"{NAME}-{rank}").stdout
        assert "Loaded Berth's CPU kernels" in log, log[-3000:]
        assert "/opt/berth-kernels/" in log
        assert "CPU kernels unavailable" not in log
        with installed.port_forward(namespace, f"svc/{NAME}-rank-{rank}", 8000) as url:
            engine_info = httpx.get(f"{url}/get_server_info", timeout=10).json()["engine"]
        assert engine_info["attention_backend"] == "berth_cpu", engine_info
        assert engine_info["cpu_kernels"].startswith("/opt/berth-kernels/"), engine_info


def test_the_router_spreads_over_both_ranks_and_the_operator_scrapes_them(
    installed: Cluster, namespace: str
) -> None:
    for rank in (0, 1):
        endpoints = installed.get(
            "endpointslices",
            "-n",
            namespace,
            "-l",
            f"kubernetes.io/service-name={NAME}-rank-{rank}",
        )["items"]
        ready = [
            e
            for s in endpoints
            for e in s.get("endpoints") or []
            if e.get("conditions", {}).get("ready")
        ]
        assert len(ready) == 1, f"rank {rank}'s Service has no ready endpoint: {endpoints}"

    def finished() -> list[float]:
        counts = []
        for rank in (0, 1):
            with installed.port_forward(namespace, f"svc/{NAME}-rank-{rank}", 8000) as url:
                counts.append(finished_requests(url))
        return counts

    before = finished()
    with installed.port_forward(namespace, f"svc/{NAME}", 80) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        def ask(i: int) -> str:
            # Distinct prompts: no shared prefix pins them all to one rank.
            question = f"Request {i}: name a colour and the fruit that has it."
            reply = client.chat.completions.create(
                model=NAME,
                messages=[{"role": "user", "content": question}],
                max_tokens=24,
                temperature=0,
            )
            return reply.choices[0].message.content or ""

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(8)))
    assert all(answers)
    after = finished()
    served = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(served) == 8, served
    assert min(served) >= 1, f"the router sent every request to one rank: {served}"

    # The operator's own scrape of both pods, over the pod network, in the status.
    def scraped() -> list[dict]:
        ranks = installed.get("inferenceservice", NAME, "-n", namespace)["status"]["ranks"]
        assert len(ranks) == 2 and all(
            r.get("lastScrape") and r.get("queued") is not None for r in ranks
        ), ranks
        return ranks

    ranks = installed.wait_until(scraped, 60, "the operator's scrape of both ranks in status")
    assert {r["rank"] for r in ranks} == {0, 1}
    assert all(r["state"] == "Serving" for r in ranks), ranks


def test_a_rank_pod_deleted_mid_stream_finishes_the_stream(
    installed: Cluster, namespace: str
) -> None:
    pod = f"{NAME}-0"
    uid = installed.get("pod", pod, "-n", namespace)["metadata"]["uid"]
    first_token = threading.Event()
    with installed.port_forward(namespace, f"pod/{pod}", 8000) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        def stream() -> tuple[str, str | None, int]:
            text, finish, chunks = "", None, 0
            for chunk in client.chat.completions.create(
                model=NAME,
                messages=[{"role": "user", "content": "Write a long story about a lighthouse."}],
                max_tokens=200,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                chunks += 1
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                first_token.set()
            return text, finish, chunks

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            result = pool.submit(stream)
            assert first_token.wait(120), "the stream never started"
            installed.kubectl("-n", namespace, "delete", "pod", pod, "--wait=false")
            text, finish, chunks = result.result(timeout=300)
    assert finish == "length", (finish, chunks, text[-200:])
    assert len(text) > 200

    def replaced() -> bool:
        current = installed.get("pod", pod, "-n", namespace)
        assert current["metadata"]["uid"] != uid
        return any(
            c["type"] == "Ready" and c["status"] == "True" for c in current["status"]["conditions"]
        )

    installed.wait_until(replaced, 300, f"the StatefulSet to bring {pod} back, Ready")
