"""`berth serve --tp-size 2` on CPU (gloo, two processes): the embedded model split unevenly
(9 query heads and 3 KV heads: 6 + 3), against the same model in one process; an MoE family
against transformers; memory per process; and a worker killed mid-request.

Exact equality cannot be promised: a split projection sums two partial products, so scores
differ from one process's by fp32 rounding (measured here: at most about 1e-5 in a logprob).
Greedy texts are compared token by token; where they part, the tokens must have been a near-tie
(top two within NEAR_TIE of each other) for one process, and logprobs before that must agree to
LOGPROB_BOUND.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.helpers import RunningServer, embedded_model_dir, kill_mid_request, wait_for
from tests.tiny_models import hf_greedy, tiny_model_dir

LOGPROB_BOUND = 1e-3
NEAR_TIE = 2e-3
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Count from 1 to 10.",
    "Explain photosynthesis in one sentence.",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to cook.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat in five words.",
]
MAX_TOKENS = 32


def serve(*args: str) -> RunningServer:
    return RunningServer(
        "--model", embedded_model_dir(), "--dtype", "float32", "--device", "cpu", *args
    ).wait_ready()


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[RunningServer, RunningServer]]:
    one, two = serve(), serve("--tp-size", "2")
    try:
        yield one, two
    finally:
        one.stop()
        two.stop()


def chat(server: RunningServer, prompt: str, model: str | None = None) -> list[dict]:
    body: dict = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    if model is not None:
        body["model"] = model
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["content"]


def compare(one: RunningServer, two: RunningServer, prompt: str, model: str | None = None):
    """(tokens compared, tokens in all): equal tokens with logprobs within LOGPROB_BOUND, up to
    a parting of the ways at a near-tie."""
    alone, split = chat(one, prompt, model), chat(two, prompt, model)
    compared = 0
    for mine, theirs in zip(alone, split):
        if mine["token"] != theirs["token"]:
            first, second = mine["top_logprobs"][:2]
            assert first["logprob"] - second["logprob"] < NEAR_TIE, (prompt, mine, theirs)
            break
        assert abs(mine["logprob"] - theirs["logprob"]) <= LOGPROB_BOUND, (prompt, mine)
        compared += 1
    else:
        assert len(alone) == len(split), prompt
    return compared, len(alone)


def test_two_processes_answer_as_one(servers) -> None:
    one, two = servers
    info = httpx.get(f"{two.base_url}/get_server_info", timeout=10).json()["engine"]
    assert info["tp_size"] == 2
    compared = total = 0
    for prompt in PROMPTS:
        done, tokens = compare(one, two, prompt)
        compared, total = compared + done, total + tokens
    assert compared >= 0.9 * total  # near-ties are rare: nearly every token was compared


def test_lora_adapters_split_in_two_answer_as_one(tmp_path) -> None:
    """LoRA adapters with --tp-size 2: each process holds its share of every update (B by rows
    where the projection splits its outputs, A by columns where it splits its inputs); an adapter
    given at start and one loaded at run time answer as with one process, and unloading one
    reaches both processes."""
    from tests.lora_adapters import make_adapter

    first = make_adapter(tmp_path / "a1", seed=1)
    second = make_adapter(tmp_path / "a2", seed=2, rank=4, targets=("o_proj", "down_proj"))
    one = serve("--lora-paths", f"a1={first}")
    two = serve("--lora-paths", f"a1={first}", "--tp-size", "2")
    try:
        for server in (one, two):
            body = {"lora_name": "a2", "lora_path": str(second)}
            loaded = httpx.post(f"{server.base_url}/load_lora_adapter", json=body, timeout=60)
            assert loaded.status_code == 200, loaded.text
        compared = total = 0
        for model in ("a1", "a2"):
            for prompt in PROMPTS[:3]:
                done, tokens = compare(one, two, prompt, model)
                compared, total = compared + done, total + tokens
        assert compared >= 0.9 * total
        unloaded = httpx.post(
            f"{two.base_url}/unload_lora_adapter", json={"lora_name": "a2"}, timeout=60
        )
        assert unloaded.status_code == 200
        assert chat(two, PROMPTS[0], "a1")  # both processes dropped it and go on together
    finally:
        one.stop()
        two.stop()


def test_a_stream_gives_the_whole_answer(servers) -> None:
    _, two = servers
    body = {
        "messages": [{"role": "user", "content": PROMPTS[1]}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    whole = httpx.post(f"{two.base_url}/v1/chat/completions", json=body, timeout=300).json()
    text = ""
    with httpx.stream(
        "POST", f"{two.base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=300
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices:
                    text += choices[0]["delta"].get("content") or ""
    assert text == whole["choices"][0]["message"]["content"] and text


def test_each_process_holds_about_half_of_the_weights(servers) -> None:
    one, two = servers
    whole = httpx.get(f"{one.base_url}/get_server_info", timeout=10).json()["engine"]
    share = httpx.get(f"{two.base_url}/get_server_info", timeout=10).json()["engine"]
    ratio = share["weight_bytes"] / whole["weight_bytes"]
    # Process 0 holds 6 of the 9 heads, half the MLP and half the vocabulary; norms are whole.
    print(f"process 0 of 2 holds {ratio:.2f} of the weights")
    assert 0.45 <= ratio <= 0.6
    workers = [
        p
        for p in (psutil.Process(pid) for pid in two.child_pids())
        if "tp-worker" in " ".join(p.cmdline())
    ]
    assert len(workers) == 1  # process 1, started by the scheduler (process 0)


def test_an_moe_model_split_in_two_answers_as_transformers() -> None:
    prompt = [(7919 * i) % 40000 + 100 for i in range(60)]
    server = RunningServer(
        "--model",
        tiny_model_dir("qwen3-moe"),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--tp-size",
        "2",
    ).wait_ready()
    try:
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        }
        response = httpx.post(f"{server.base_url}/generate", json=body, timeout=300)
        assert response.status_code == 200, response.text
        assert response.json()["output_ids"] == hf_greedy("qwen3-moe", prompt, 12)
    finally:
        server.stop()


def test_a_killed_worker_fails_the_request_and_ends_the_rank() -> None:
    server = serve("--tp-size", "2")
    try:
        (worker,) = [
            p
            for p in (psutil.Process(pid) for pid in server.child_pids())
            if "tp-worker" in " ".join(p.cmdline())
        ]
        kill_mid_request(server, worker)
    finally:
        server.stop()


def test_sigterm_to_the_group_drains_then_every_process_exits() -> None:
    """As `kubectl delete pod` does: SIGTERM to the whole process group. The request in flight
    finishes on both processes, the server exits 0, and no process is left."""
    server = serve("--tp-size", "2", "--graceful-shutdown-timeout", "120")
    children = server.child_pids()
    assert any("tp-worker" in " ".join(psutil.Process(pid).cmdline()) for pid in children)
    result: dict = {}
    body = {"text": "Count slowly:", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    thread = threading.Thread(
        target=lambda: result.update(
            r=httpx.post(f"{server.base_url}/generate", json=body, timeout=300)
        )
    )
    thread.start()
    wait_for(
        lambda: httpx.get(f"{server.base_url}/get_load").json().get("num_running_reqs") == 1,
        30,
        what="the request to run",
    )
    os.killpg(os.getpgid(server.proc.pid), signal.SIGTERM)
    thread.join(300)
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["meta_info"]["completion_tokens"] == 200
    assert server.proc.wait(60) == 0
    server.stop()
    wait_for(
        lambda: (
            not [
                p
                for p in children
                if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
            ]
        ),
        15,
        what="every process to exit",
    )


def test_a_hung_worker_fails_the_request_and_ends_the_rank_at_the_watchdog() -> None:
    """A worker that stops answering (SIGSTOP) holds up process 0 in a collective: the step
    outlasts --watchdog-timeout, the request gets a 5xx and the server exits non-zero; the
    frozen worker goes with its scheduler (the parent-death signal)."""
    server = serve("--tp-size", "2", "--watchdog-timeout", "10")
    try:
        (worker,) = [
            p
            for p in (psutil.Process(pid) for pid in server.child_pids())
            if "tp-worker" in " ".join(p.cmdline())
        ]
        kill_mid_request(server, worker, freeze=True, within=45)
        wait_for(lambda: not psutil.pid_exists(worker.pid) or worker.status() == "zombie", 15)
    finally:
        server.stop()
