"""Structured output on a real server with real clients: the openai SDK's `parse()` with pydantic
models, JSON schemas sampled at temperature 1 (streamed and not), `json_object`, a regex and an
EBNF grammar on `/generate`, bad grammars, and constrained and free requests mixed in one batch.

The schemas bound their strings, numbers and arrays, as a schema must for a 135M model at
temperature 1 to finish within `max_tokens`: the grammar guarantees what the output may be, not
when the model decides to end a free-length string.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.helpers import RunningServer
from tests.integration.runtime.conftest import MODEL

CHAT = "/v1/chat/completions"


class City(BaseModel):
    name: str = Field(max_length=20)
    country: Literal["France", "Italy", "Spain"]
    population: int = Field(ge=0, le=100_000_000)


class Landmark(BaseModel):
    name: str = Field(max_length=24)
    year: int = Field(ge=1000, le=2030)


class Guide(BaseModel):
    """Nested objects, an enum, an array and an optional field."""

    city: City
    landmarks: list[Landmark] = Field(max_length=3)
    tip: str | None = Field(max_length=30)


class Flags(BaseModel):
    open_now: bool
    rating: float = Field(ge=0, le=5)
    tags: list[Literal["food", "art", "history", "park"]] = Field(min_length=1, max_length=4)


def ask(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize(
    ("model", "question"),
    [
        (City, "Describe Paris as JSON."),
        (Guide, "A short travel guide to Rome, as JSON."),
        (Flags, "Is the Louvre open now? Give flags as JSON."),
    ],
    ids=["flat", "nested", "bool-number-enum-array"],
)
def test_the_sdks_parse_returns_the_pydantic_object(
    client: openai.OpenAI, model: type[BaseModel], question: str
) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=ask(question), response_format=model, max_tokens=300
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, model), choice.message.content
    # Compact JSON, as the grammar writes it; the same object as the parsed one.
    assert json.loads(choice.message.content) == choice.message.parsed.model_dump(mode="json")


def test_every_sample_at_temperature_1_matches_the_schema_streamed_or_not(
    client: openai.OpenAI,
) -> None:
    schema = City.model_json_schema()
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    samples: list[str] = []
    for seed in range(2):
        completion = client.chat.completions.create(
            model=MODEL,
            messages=ask("Describe Madrid as JSON."),
            response_format=response_format,  # type: ignore[arg-type]
            temperature=1.0,
            n=8,
            seed=seed,
            max_tokens=100,
        )
        assert all(c.finish_reason == "stop" for c in completion.choices)
        samples += [c.message.content or "" for c in completion.choices]
        stream = client.chat.completions.create(
            model=MODEL,
            messages=ask("Describe Lisbon as JSON."),
            response_format=response_format,  # type: ignore[arg-type]
            temperature=1.0,
            n=4,
            seed=seed,
            max_tokens=100,
            stream=True,
        )
        streamed = [""] * 4
        for chunk in stream:
            for choice in chunk.choices:
                streamed[choice.index] += choice.delta.content or ""
        samples += streamed
    assert len(samples) == 24
    for sample in samples:
        jsonschema.validate(json.loads(sample), schema)
    assert len(set(samples)) > 1  # temperature 1 really sampled


def test_json_object_mode_answers_a_json_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ask("Give me a JSON object describing a cat."),
        response_format={"type": "json_object"},
        max_tokens=400,
    )
    choice = completion.choices[0]
    # A free-form object may be longer than max_tokens; whatever came is an object's start.
    assert (choice.message.content or "").startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)


def test_completions_take_a_response_format_and_sglangs_regex(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "The year the Eiffel Tower opened:", "max_tokens": 10}
    regex = http.post("/v1/completions", json={**body, "regex": "1[0-9]{3}"}).json()
    assert re.fullmatch("1[0-9]{3}", regex["choices"][0]["text"]), regex
    schema = {"type": "object", "properties": {"year": {"type": "integer"}}, "required": ["year"]}
    formatted = http.post(
        "/v1/completions",
        json={
            **body,
            "max_tokens": 20,
            "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
        },
    ).json()
    jsonschema.validate(json.loads(formatted["choices"][0]["text"]), schema)


def test_generate_takes_sglangs_regex_and_ebnf_sampling_parameters(http: httpx.Client) -> None:
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    out = http.post(
        "/generate",
        json={
            "text": "Call us at ",
            "sampling_params": {"regex": phone, "temperature": 1.0, "max_new_tokens": 30},
        },
    ).json()
    assert re.fullmatch(phone, out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    grammar = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{1,40}'
    out = http.post(
        "/generate",
        json={
            "text": "Is the sky blue? Answer: ",
            "sampling_params": {"ebnf": grammar, "max_new_tokens": 30},
        },
    ).json()
    assert re.fullmatch(r"(yes|no) because [a-z ]{1,40}", out["text"]), out["text"]
    schema = json.dumps({"type": "array", "items": {"type": "integer"}, "maxItems": 3})
    out = http.post(
        "/generate",
        json={"text": "Three numbers: ", "sampling_params": {"json_schema": schema}},
    ).json()
    assert len(json.loads(out["text"])) <= 3


@pytest.mark.parametrize(
    ("path", "fields", "param", "message"),
    [
        (
            CHAT,
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
            "response_format",
            'invalid json schema: Unsupported type "x"',
        ),
        (CHAT, {"regex": "a(b"}, "regex", "invalid regex: Regex parsing error"),
        (CHAT, {"ebnf": "root ::= nothing"}, "ebnf", 'Rule "nothing" is not defined'),
        (
            CHAT,
            {"response_format": {"type": "json_object"}, "regex": "a"},
            "regex",
            "at most one of response_format and regex",
        ),
        (
            "/generate",
            {"sampling_params": {"json_schema": "{not json"}},
            "sampling_params.json_schema",
            "Failed to parse JSON",
        ),
        (
            "/generate",
            {"sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
            "ebnf",
            "at most one of json_schema, regex and ebnf",
        ),
    ],
)
def test_a_bad_grammar_is_a_400_with_the_engines_message(
    http: httpx.Client, path: str, fields: dict, param: str, message: str
) -> None:
    base = {"model": MODEL, "messages": ask("hi")} if path == CHAT else {"text": "hi"}
    response = http.post(path, json={**base, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_constrained_and_free_requests_mixed_each_get_their_kind(server: RunningServer) -> None:
    schema = City.model_json_schema()

    def one(i: int) -> tuple[int, str, str]:
        body: dict = {
            "model": MODEL,
            "messages": ask(f"Tell me about city number {i}."),
            "max_tokens": 120,
            "temperature": 1.0,
            "seed": i,
        }
        if i % 2 == 0:
            body["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
        else:
            body["max_tokens"] = 24
        response = httpx.post(f"{server.base_url}{CHAT}", json=body, timeout=300)
        choice = response.json()["choices"][0]
        return i, choice["message"]["content"], choice["finish_reason"]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    free_json = 0
    for i, content, finish in results:
        if i % 2 == 0:
            assert finish == "stop"
            jsonschema.validate(json.loads(content), schema)
        else:
            try:
                json.loads(content)
                free_json += 1
            except ValueError:
                pass
    assert free_json < 8, "the free requests were constrained too"


def test_a_server_without_a_grammar_backend_refuses_constrained_requests() -> None:
    server = RunningServer("--grammar-backend", "none").wait_ready()
    try:
        response = httpx.post(
            f"{server.base_url}{CHAT}",
            json={"messages": ask("hi"), "response_format": {"type": "json_object"}},
            timeout=60,
        )
        assert response.status_code == 400
        assert "--grammar-backend none" in response.json()["error"]["message"]
    finally:
        assert server.stop() == 0
