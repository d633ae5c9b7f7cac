"""LoRA adapters on a real `berth serve` of the embedded model (fp32, CPU): PEFT adapters made here
with random non-zero weights, served beside the base model and checked against transformers +
PEFT; mixed batches, the prefix cache per adapter, slots and eviction, loading and unloading at
run time, and the errors."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from tests.helpers import RunningServer, embedded_model_dir, metric, scrape
from tests.lora_adapters import make_adapter, peft_greedy

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "Give me a tip for learning to cook.",
]
MAX_TOKENS = 24
SLOTS = 2  # --max-loras-per-batch: three adapters in use must evict


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        # Every projection, rank 8.
        "a1": make_adapter(root / "a1", seed=1),
        # Queries and values only, rank 4, stronger.
        "a2": make_adapter(root / "a2", seed=2, rank=4, targets=("q_proj", "v_proj"), std=0.04),
        # The MLP only, rank 16, loaded at run time.
        "a3": make_adapter(
            root / "a3", seed=3, rank=16, targets=("gate_proj", "up_proj", "down_proj")
        ),
        "a4": make_adapter(root / "a4", seed=4, rank=8, targets=("o_proj", "k_proj"), std=0.08),
    }


@pytest.fixture(scope="module")
def expected(adapters: dict[str, Path]) -> dict[str | None, list[str]]:
    """transformers + PEFT's greedy answers, per adapter (None: the base model)."""
    names: list[str | None] = [None, *adapters]
    return {
        name: peft_greedy(adapters[name] if name else None, PROMPTS, MAX_TOKENS) for name in names
    }


@pytest.fixture(scope="module")
def server(adapters: dict[str, Path]) -> Iterator[RunningServer]:
    """The adapters' server; the conftest's `http` client talks to it."""
    srv = RunningServer(
        "--model",
        embedded_model_dir(),
        "--served-model-name",
        "base",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--lora-paths",
        f"a1={adapters['a1']}",
        f"a2={adapters['a2']}",
        "--max-loras-per-batch",
        str(SLOTS),
        "--max-lora-rank",
        "16",
    ).wait_ready()
    yield srv
    srv.stop()


def chat(http: httpx.Client, prompt: str, model: str | None) -> dict:
    body: dict = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    if model is not None:
        body["model"] = model
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def answer(http: httpx.Client, prompt: str, model: str | None) -> str:
    return chat(http, prompt, model)["choices"][0]["message"]["content"]


def load(http: httpx.Client, name: str, path: Path | str) -> httpx.Response:
    return http.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def test_adapters_answer_as_peft(http: httpx.Client, expected: dict) -> None:
    """Each adapter's greedy answers equal transformers + PEFT's, and differ from the base's:
    the adapter is really applied."""
    for name in (None, "a1", "a2"):
        got = [answer(http, prompt, name) for prompt in PROMPTS]
        assert got == expected[name], name
    for name in ("a1", "a2"):
        assert expected[name] != expected[None], f"{name} changes no answer: a useless check"


def test_model_names_and_listing(http: httpx.Client, expected: dict) -> None:
    """`base:NAME` selects an adapter as `NAME` does; the response names the model asked for;
    /v1/models lists the adapters with their base as parent."""
    body = chat(http, PROMPTS[0], "base:a1")
    assert body["choices"][0]["message"]["content"] == expected["a1"][0]
    assert body["model"] == "base:a1"
    assert chat(http, PROMPTS[0], "a1")["model"] == "a1"
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert cards["base"]["parent"] is None
    assert cards["a1"]["parent"] == "base" and cards["a2"]["parent"] == "base"
    assert http.get("/v1/models/a2").json()["root"].endswith("a2")
    # /generate names the adapter with `lora_path`, as SGLang's does; completions with `model`.
    ids = http.post(
        "/generate",
        json={
            "text": "The sea is",
            "lora_path": "a2",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        },
    )
    completion = http.post(
        "/v1/completions",
        json={"model": "a2", "prompt": "The sea is", "max_tokens": 8, "temperature": 0},
    )
    assert ids.status_code == 200 and completion.status_code == 200
    assert ids.json()["text"] == completion.json()["choices"][0]["text"]


def test_mixed_batch_gives_each_its_solo_answer(http: httpx.Client, expected: dict) -> None:
    """Base and two adapters in one batch: every request gets the answer it gets alone."""
    jobs = [(name, i) for name in (None, "a1", "a2") for i in range(len(PROMPTS))]
    results: dict[tuple, str] = {}

    def run(name: str | None, index: int) -> None:
        with httpx.Client(base_url=str(http.base_url), timeout=120) as client:
            results[(name, index)] = answer(client, PROMPTS[index], name)

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name, index in jobs:
        assert results[(name, index)] == expected[name][index], (name, index)


def test_prefix_cache_is_kept_per_adapter(http: httpx.Client, expected: dict) -> None:
    """A prompt cached under one adapter is reused by the same adapter only: another adapter and
    the base compute it afresh (no cached tokens), and every answer stays its own."""
    prompt = PROMPTS[3]
    http.post("/flush_cache")
    first = chat(http, prompt, "a1")
    again = chat(http, prompt, "a1")
    other = chat(http, prompt, "a2")
    base = chat(http, prompt, None)

    def cached(body: dict) -> int:
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(first) == 0 and cached(again) > 0
    assert cached(other) == 0 and cached(base) == 0
    for body, name in ((first, "a1"), (again, "a1"), (other, "a2"), (base, None)):
        assert body["choices"][0]["message"]["content"] == expected[name][3]


def test_load_use_unload_reload(http: httpx.Client, adapters: dict, expected: dict) -> None:
    """An adapter loaded at run time serves at once; unloaded, it is a 404 and gone from the
    list; a new adapter loaded under the same name answers as itself, not from the old one's
    cached prefixes."""
    assert load(http, "live", adapters["a3"]).status_code == 200
    assert answer(http, PROMPTS[1], "live") == expected["a3"][1]
    assert "live" in {card["id"] for card in http.get("/v1/models").json()["data"]}
    unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "live"})
    assert unloaded.status_code == 200, unloaded.text
    gone = http.post(
        "/v1/chat/completions",
        json={"model": "live", "messages": [{"role": "user", "content": PROMPTS[1]}]},
    )
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert "live" in gone.json()["error"]["message"]
    assert "live" not in {card["id"] for card in http.get("/v1/models").json()["data"]}
    assert load(http, "live", adapters["a4"]).status_code == 200
    assert answer(http, PROMPTS[1], "live") == expected["a4"][1]
    assert http.post("/unload_lora_adapter", json={"lora_name": "live"}).status_code == 200


def test_more_adapters_than_slots(http: httpx.Client, adapters: dict, expected: dict) -> None:
    """Four adapters over two slots, at once: each request waits for a slot, is answered as its
    adapter, and no more adapters than slots are ever resident."""
    for name in ("a3", "a4"):
        assert load(http, name, adapters[name]).status_code == 200
    try:
        names = ["a1", "a2", "a3", "a4"]
        results: dict[str, list[str]] = {}
        resident: list[str] = []
        done = threading.Event()

        def run(name: str) -> None:
            with httpx.Client(base_url=str(http.base_url), timeout=300) as client:
                results[name] = [answer(client, prompt, name) for prompt in PROMPTS[:2]]

        def watch() -> None:
            while not done.is_set():
                for line in http.get("/metrics").text.splitlines():
                    if line.startswith("vllm:lora_requests_info{"):
                        resident.append(line.split('running_lora_adapters="')[1].split('"')[0])

        threads = [threading.Thread(target=run, args=(name,)) for name in names]
        watcher = threading.Thread(target=watch)
        watcher.start()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        done.set()
        watcher.join()
        for name in names:
            assert results[name] == expected[name][:2], name
        assert resident and all(len([a for a in r.split(",") if a]) <= SLOTS for r in resident)
        assert len({a for r in resident for a in r.split(",") if a}) > SLOTS  # it did evict
    finally:
        for name in ("a3", "a4"):
            http.post("/unload_lora_adapter", json={"lora_name": name})


def test_unload_waits_for_running_requests(http: httpx.Client, adapters: dict) -> None:
    """Unloading an adapter with a request streaming on it: the stream ends whole, then the
    unload answers; new requests are refused from the moment the unload began."""
    assert load(http, "busy", adapters["a1"]).status_code == 200
    received: list[dict] = []  # the stream's chunks, as they arrive
    unloaded_after: list[int] = []  # how many had arrived when the unload answered
    body = {
        "model": "busy",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 120,
        "min_tokens": 120,
        "temperature": 0,
        "stream": True,
    }

    def stream() -> None:
        with (
            httpx.Client(base_url=str(http.base_url), timeout=300) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    received.append(json.loads(line.removeprefix("data: ")))

    def unload() -> None:
        with httpx.Client(base_url=str(http.base_url), timeout=300) as client:
            out = client.post("/unload_lora_adapter", json={"lora_name": "busy"})
            assert out.status_code == 200, out.text
            unloaded_after.append(len(received))

    streamer = threading.Thread(target=stream)
    streamer.start()
    for _ in range(600):  # until the stream is under way
        if len(received) >= 5:
            break
        threading.Event().wait(0.05)
    unloader = threading.Thread(target=unload)
    unloader.start()
    threading.Event().wait(0.3)
    refused = http.post(
        "/v1/chat/completions",
        json={"model": "busy", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert refused.status_code == 404
    streamer.join()
    unloader.join()
    assert received[-1]["choices"][0]["finish_reason"] == "length"
    content = [c for c in received if c["choices"][0]["delta"].get("content")]
    assert len(content) == 120  # the stream ended whole
    # The unload answered once the request had finished in the scheduler: its reply comes
    # straight from there, the stream's last tokens through the detokenizer, so a few may still
    # be on their way to the client.
    assert unloaded_after and unloaded_after[0] >= 100, unloaded_after


def test_errors(http: httpx.Client, adapters: dict, tmp_path: Path) -> None:
    """Unknown adapters are 404s naming them; adapters that cannot be served are refused at
    load with a 400 that says why; the name is taken: 409."""
    unknown = http.post(
        "/v1/chat/completions",
        json={"model": "base:nope", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert unknown.status_code == 404
    assert "`nope`" in unknown.json()["error"]["message"]
    generate = http.post("/generate", json={"text": "hi", "lora_path": "nope"})
    assert generate.status_code == 404 and "nope" in generate.json()["error"]["message"]

    def refused(name: str, path: Path | str, status: int, words: str) -> None:
        out = load(http, name, path)
        assert out.status_code == status, out.text
        assert words in out.json()["error"]["message"], out.text

    refused("a1", adapters["a3"], 409, "loaded already")
    refused("x", tmp_path / "missing", 400, "no adapter_config.json")
    # Rank 32 over --max-lora-rank 16.
    refused("x", make_adapter(tmp_path / "big", seed=5, rank=32), 400, "--max-lora-rank 16")
    # The output head: not a projection Berth adapts.
    head = make_adapter(tmp_path / "head", seed=6, targets=("lm_head",))
    refused("x", head, 400, "lm_head")
    # Trained for another base: a lora_A narrower than this model's hidden size.
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((adapters["a2"] / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps(config))
    weights = load_file(adapters["a2"] / "adapter_model.safetensors")
    save_file(
        {k: v[:, :64].contiguous() if "lora_A" in k else v for k, v in weights.items()},
        other / "adapter_model.safetensors",
    )
    refused("x", other, 400, "does not fit the base model")
    assert http.post("/unload_lora_adapter", json={"lora_name": "nope"}).status_code == 404
    assert "x" not in {card["id"] for card in http.get("/v1/models").json()["data"]}


def test_lora_off_refuses_adapters() -> None:
    """A server started without --enable-lora refuses to load adapters and requests for one."""
    srv = RunningServer("--model", embedded_model_dir(), "--dtype", "float32").wait_ready()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as http:
            out = load(http, "a", "/nowhere")
            assert out.status_code == 400 and "--enable-lora" in out.json()["error"]["message"]
            generate = http.post("/generate", json={"text": "hi", "lora_path": "a"})
            assert generate.status_code == 400
            assert "--enable-lora" in generate.json()["error"]["message"]
    finally:
        srv.stop()


def test_speculative_decoding_keeps_each_adapters_answers(adapters: dict, expected: dict) -> None:
    """Prompt-lookup drafts verified under the request's adapter: answers as without them."""
    srv = RunningServer(
        "--model", embedded_model_dir(), "--served-model-name", "base", "--dtype", "float32",
        "--device", "cpu", "--speculative-algorithm", "ngram", "--lora-paths",
        f"a1={adapters['a1']}", f"a2={adapters['a2']}",
    ).wait_ready()  # fmt: skip
    try:
        with httpx.Client(base_url=srv.base_url, timeout=300) as client:
            for name in (None, "a1", "a2"):
                assert [answer(client, p, name) for p in PROMPTS] == expected[name], name
            drafts = metric(scrape(srv.base_url), "berth:spec_decode_num_draft_tokens")
            assert drafts > 0  # verification steps ran
    finally:
        srv.stop()
