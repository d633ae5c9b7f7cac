"""The OpenAI-compatible API of a real server, driven by the `openai` SDK and httpx."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.integration.runtime.conftest import MODEL

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_answers_paris(client: openai.OpenAI):
    resp = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_tokens=32
    )
    choice = resp.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert resp.usage.completion_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_text_part_content(client: openai.OpenAI):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}
    ]
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=32
    )
    plain = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_tokens=32
    )
    assert resp.choices[0].message.content == plain.choices[0].message.content


def test_chat_stream_matches_non_stream(client: openai.OpenAI):
    kwargs = {"model": MODEL, "messages": CAPITAL, "temperature": 0, "max_tokens": 24}
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_length_finish_and_exact_usage(client: openai.OpenAI, server):
    resp = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 7
    ids = httpx.post(
        f"{server.base_url}/generate",
        json={
            "text": "Once upon a time",
            "sampling_params": {"max_new_tokens": 7, "temperature": 0},
        },
    ).json()
    assert resp.usage.prompt_tokens == ids["meta_info"]["prompt_tokens"]
    assert resp.choices[0].text == ids["text"]


def test_stop_string_never_leaks(client: openai.OpenAI):
    base = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0
    )
    assert " 6" in base.choices[0].text, base.choices[0].text
    for stream in (False, True):
        kwargs = {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 16, "temperature": 0}
        if stream:
            chunks = list(client.completions.create(**kwargs, stop=[" 6"], stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            resp = client.completions.create(**kwargs, stop=[" 6"])
            text, finish = resp.choices[0].text, resp.choices[0].finish_reason
        assert text == base.choices[0].text.split(" 6")[0]
        assert " 6" not in text
        assert finish == "stop"


def test_n_choices_with_seed(client: openai.OpenAI):
    kwargs = {
        "model": MODEL,
        "messages": CAPITAL,
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 7,
        "n": 2,
    }
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert first.usage == again.usage
    assert first.usage.prompt_tokens > 0


def test_chat_logprobs(client: openai.OpenAI):
    resp = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for item in content:
        assert item.logprob <= 0
        assert len(item.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-5)


def test_completion_echo_with_prompt_logprobs(client: openai.OpenAI):
    resp = client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    choice = resp.choices[0]
    assert choice.text.startswith("The sky is")
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert len(lp.tokens) == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text


def test_prompt_as_token_ids_and_list(client: openai.OpenAI, http: httpx.Client):
    ids = http.post(
        "/generate", json={"text": "Hello there", "sampling_params": {"max_new_tokens": 1}}
    ).json()
    assert ids["meta_info"]["prompt_tokens"] >= 2
    resp = client.completions.create(
        model=MODEL, prompt=["Hello there", "The sky is"], max_tokens=4, temperature=0
    )
    assert [c.index for c in resp.choices] == [0, 1]
    single = client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=4, temperature=0
    )
    assert resp.choices[1].text == single.choices[0].text


def test_models_endpoint(client: openai.OpenAI, http: httpx.Client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    # The model as the server was started with it, never a path on the server's disk.
    assert http.get("/v1/models").json()["data"][0]["root"] == "builtin://smollm2-135m-instruct"
    assert http.get(f"/v1/models/{MODEL}").status_code == 200
    missing = http.get("/v1/models/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def test_native_generate_stream_and_meta(http: httpx.Client):
    body = {
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": 5, "temperature": 0},
    }
    full = http.post("/generate", json=body).json()
    assert full["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    assert full["meta_info"]["completion_tokens"] == len(full["output_ids"])
    events = []
    with http.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    outs = [json.loads(e) for e in events[:-1]]
    assert outs[-1]["text"] == full["text"]
    assert outs[-1]["output_ids"] == full["output_ids"]
    texts = [o["text"] for o in outs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "text must only grow"


def test_info_endpoints(http: httpx.Client):
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True
    assert info["context_length"] == 8192
    server_info = http.get("/get_server_info").json()
    assert server_info["phase"] == "ready"
    assert server_info["server_args"]["dtype"] == "float32"
    # --attention-backend auto: Berth's CPU kernels, built on this machine.
    assert server_info["engine"]["attention_backend"] == "berth_cpu"
    assert server_info["engine"]["cpu_kernels"].endswith(".so")
    assert "api_key" not in server_info["server_args"]
    load = http.get("/get_load").json()
    assert load["max_total_num_tokens"] > 0
    assert {"num_running_reqs", "num_waiting_reqs", "token_usage"} <= set(load)


def test_a_request_pinned_to_another_rank_is_refused(http: httpx.Client):
    """This server is rank 0 (no --dp-rank): a request pinned elsewhere is refused, not served
    here as if it had reached the rank it names."""
    body = {"model": MODEL, "messages": CAPITAL, "max_tokens": 2}
    for pin in (
        {"json": {**body, "routed_dp_rank": 1}},
        {"headers": {"X-Data-Parallel-Rank": "3"}},
    ):
        response = http.post("/v1/chat/completions", **{"json": body, **pin})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "routed_dp_rank" and "another rank" in error["message"]
    native = http.post("/generate", json={"text": "Hi", "routed_dp_rank": 2})
    assert native.status_code == 400 and native.json()["error"]["param"] == "routed_dp_rank"
    assert http.post("/v1/chat/completions", json={**body, "routed_dp_rank": 0}).status_code == 200


# --- what OpenAI clients trip on ---------------------------------------------------------------


def test_developer_messages_work_as_system_messages(client: openai.OpenAI):
    def answer(role: str) -> str:
        resp = client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": role, "content": "Answer with one word."},
                {"role": "user", "content": "What colour is the sky?"},
            ],
            max_tokens=8,
            temperature=0,
        )
        return resp.choices[0].message.content or ""

    assert answer("developer") == answer("system")


def test_every_response_carries_a_request_id_and_echoes_the_clients(
    client: openai.OpenAI, http: httpx.Client
):
    resp = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert resp.request_id and len(resp.request_id) >= 16  # the SDK's `_request_id`
    mine = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
        headers={"X-Request-Id": "trace-42"},
    )
    assert mine.headers["x-request-id"] == "trace-42"
    error = http.get("/v1/embeddings", headers={"X-Request-Id": "trace-43"})
    assert error.status_code in (404, 405) and error.headers["x-request-id"] == "trace-43"


def test_parameters_it_cannot_honour_are_refused_naming_them(client: openai.OpenAI):
    # OpenAI's deprecated functions: refused, naming them (tools are served instead).
    function = {"name": "now", "parameters": {"type": "object"}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], functions=[function]
        )
    assert info.value.param == "functions" and "not supported" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Once", suffix=" the end.", max_tokens=4)
    assert info.value.param == "suffix"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Once", best_of=3, max_tokens=4)
    assert info.value.param == "best_of"
    # Accepted: parameters that change nothing here.
    ok = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        user="u-1",
        store=False,
        metadata={"team": "a"},
        service_tier="auto",
    )
    assert ok.choices[0].finish_reason == "length"


def test_a_context_overflow_is_the_error_clients_recognise(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello " * 9000}]
        )
    assert info.value.code == "context_length_exceeded"
    assert "maximum context length" in info.value.message


def test_embeddings_say_this_model_serves_none(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model=MODEL, input="hi")
    assert info.value.code == "model_not_supported" and "no embeddings" in info.value.message


# "日" is three bytes, e6 97 a5: this vocabulary has a token for its first two ("æĹ", id 23274)
# and one for the last. Forcing the first token with max_tokens 1 ends the answer mid-character.
FIRST_TWO_BYTES_OF_NICHI = 23274


def test_logprob_bytes_are_the_tokens_own_and_no_half_character_is_sent(
    client: openai.OpenAI,
):
    forced = {"logit_bias": {str(FIRST_TWO_BYTES_OF_NICHI): 100}, "max_tokens": 1}
    messages = [{"role": "user", "content": "Say a word."}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, logprobs=True, **forced
    )
    token = reply.choices[0].logprobs.content[0]
    assert token.bytes == [0xE6, 0x97]  # not U+FFFD's ef bf bd
    assert reply.choices[0].message.content == ""
    assert reply.choices[0].finish_reason == "length"

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, stream=True, **forced
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ""

    completion = client.completions.create(model=MODEL, prompt="A word:", **forced)
    assert completion.choices[0].text == ""


def test_a_character_split_over_tokens_is_rebuilt_from_their_bytes(client: openai.OpenAI):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Repeat exactly: 日本 café 🚀"}],
        temperature=0,
        max_tokens=30,
        logprobs=True,
    )
    tokens = reply.choices[0].logprobs.content
    joined = b"".join(bytes(t.bytes) for t in tokens).decode("utf-8", errors="strict")
    assert joined == reply.choices[0].message.content
    assert any(t.token == "\ufffd" for t in tokens), "no token held part of a character"
