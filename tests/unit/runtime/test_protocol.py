"""The OpenAI request models validate what clients send, and the response models match the SDK's."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from berth_common.errors import RequestError
from berth_runtime.constrained.spec import GrammarSpec
from berth_runtime.entrypoints.protocol import (
    JSON_OBJECT_SCHEMA,
    ChatCompletionChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatCompletionTokenLogprob,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
    validation_error,
)
from berth_runtime.entrypoints.serving_chat import template_message

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def rejected_param(model: type[ChatCompletionRequest | CompletionRequest], body: dict) -> str:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    err = validation_error(info.value.errors())
    assert err.status_code == 400
    return err.param or ""


def test_text_parts_are_joined_and_null_means_unset() -> None:
    request = ChatCompletionRequest.model_validate(
        {
            "model": None,
            "n": None,
            "temperature": None,
            "messages": [
                {"role": "system", "content": None},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
        }
    )
    assert [m.content for m in request.messages] == ["", "a\nb"]
    assert (request.model, request.n, request.temperature) == (None, 1, 1.0)


def test_fields_openai_does_not_have_are_ignored() -> None:
    request = chat(vendor_extension={"x": 1}, best_of=3)  # best_of is a completions parameter
    assert "vendor_extension" not in request.model_dump() and "best_of" not in request.model_dump()


def test_openai_parameters_that_ask_for_nothing_or_change_nothing_are_accepted() -> None:
    request = chat(
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        modalities=["text"],
        user="u-1",
        store=False,
        metadata={"k": "v"},
        service_tier="auto",
        parallel_tool_calls=True,
    )
    assert request.user == "u-1" and request.tools == []


def test_developer_messages_are_system_messages_to_the_template() -> None:
    request = chat(messages=[{"role": "developer", "content": "Be terse."}, *USER])
    assert template_message(request.messages[0]) == {"role": "system", "content": "Be terse."}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"suffix": " the end"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"best_of": 2, "n": 3}, "best_of"),
    ],
)
def test_completion_parameters_it_cannot_honour_are_refused(fields: dict, param: str) -> None:
    assert rejected_param(CompletionRequest, {"prompt": "x", **fields}) == param
    assert CompletionRequest.model_validate({"prompt": "x", "suffix": "", "best_of": 1, "n": 1})


def test_image_parts_are_rejected_with_a_clear_message() -> None:
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
        ]
    }
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    err = validation_error(info.value.errors())
    assert err.param == "messages.0.content"
    assert "'image_url' are not supported; only text parts are" in err.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"seed": 2**63}, "seed"),
        ({"seed": 2**53}, "seed"),  # integers are JSON-safe: 53 bits
        ({"n": "2"}, "n"),
        ({"n": 1.5}, "n"),
        ({"logit_bias": {"abc": 1}}, "logit_bias.abc"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"stop": 5}, "stop"),
        ({"stop": ["x"] * 65}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema.schema",
        ),
        ({"audio": {"voice": "alloy"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"rid": ""}, "rid"),
        ({"routed_dp_rank": -1}, "routed_dp_rank"),
        ({"priority": "high"}, "priority"),
        ({"stream": "false"}, "stream"),  # booleans are strict: a string is a client bug
        ({"logprobs": 1}, "logprobs"),
        ({"stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
    ],
)
def test_chat_field_errors_name_the_field(fields: dict, param: str) -> None:
    assert rejected_param(ChatCompletionRequest, {"messages": USER, **fields}) == param


def test_one_constraint_at_most_and_what_each_asks_for() -> None:
    both = ChatCompletionRequest(messages=USER, response_format={"type": "json_object"}, regex="a+")
    with pytest.raises(RequestError) as caught:
        both.grammar()
    assert caught.value.param == "regex"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    asked = {
        "text": ChatCompletionRequest(messages=USER, response_format={"type": "text"}),
        "object": ChatCompletionRequest(messages=USER, response_format={"type": "json_object"}),
        "schema": ChatCompletionRequest(
            messages=USER,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        ),
        "ebnf": CompletionRequest(prompt="x", ebnf='root ::= "a"'),
    }
    assert asked["text"].grammar() is None
    assert asked["object"].grammar() == (
        "response_format",
        GrammarSpec("json_schema", JSON_OBJECT_SCHEMA),
    )
    assert asked["schema"].grammar() == (
        "response_format",
        GrammarSpec("json_schema", json.dumps(schema)),
    )
    assert asked["ebnf"].grammar() == ("ebnf", GrammarSpec("ebnf", 'root ::= "a"'))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [""]}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": ["a", 1]}, "prompt"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({}, "prompt"),
    ],
)
def test_completion_field_errors_name_the_field(fields: dict, param: str) -> None:
    assert rejected_param(CompletionRequest, fields) == param


def test_accepted_values_at_the_bounds() -> None:
    request = chat(
        temperature=0,
        top_p=1,
        top_k=0,
        min_p=1,
        n=128.0,  # an integer, as JSON Schema reads numbers
        seed=-(2**53 - 1),
        stop="END",
        logit_bias={"0": -100, "12": 100},
        logprobs=True,
        top_logprobs=20,
        stream_options={"include_usage": True},
    )
    assert request.logit_bias == {0: -100.0, 12: 100.0}
    assert request.n == 128 and isinstance(request.n, int)
    assert request.include_usage
    assert not chat(stream_options={}).include_usage


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert chat(max_tokens=50, max_completion_tokens=40).max_new_tokens == 40
    assert chat(max_tokens=50).max_new_tokens == 50
    assert chat().max_new_tokens is None


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([0], [[0]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_shapes(prompt: Any, prompts: list) -> None:
    request = CompletionRequest.model_validate({"prompt": prompt})
    assert request.prompts() == prompts
    assert (request.max_tokens, request.logprobs, request.echo) == (16, None, False)


def test_validation_error_strips_the_body_prefix_and_lists_every_error() -> None:
    err = validation_error(
        [
            {"loc": ("body", "messages", 0, "content"), "msg": "bad part"},
            {"loc": ("body", "n"), "msg": "too big"},
        ]
    )
    assert err.param == "messages.0.content"
    assert err.message == "messages.0.content: bad part; n: too big"
    assert err.body()["error"]["type"] == "BadRequestError"
    assert validation_error([{"loc": ("body",), "msg": "not an object"}]).param is None
    empty = validation_error([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    assert empty.message == "the request has no body: send a JSON object"


def test_responses_parse_as_the_openai_sdk_types() -> None:
    usage = UsageInfo(
        prompt_tokens=5,
        completion_tokens=2,
        total_tokens=7,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=3),
    )
    top = TopLogprob(token="Hi", logprob=-0.5, bytes=[72, 105])
    logprobs = ChoiceLogprobs(
        content=[ChatCompletionTokenLogprob(**top.model_dump(), top_logprobs=[top])]
    )
    response = ChatCompletionResponse(
        id="chatcmpl-1",
        model="m",
        choices=[
            ChatCompletionChoice(
                index=0,
                message=ChatCompletionMessage(content="Hi"),
                logprobs=logprobs,
                finish_reason="stop",
            )
        ],
        usage=usage,
    )
    parsed = ChatCompletion.model_validate_json(response.model_dump_json())
    assert parsed.choices[0].message.content == "Hi"
    assert parsed.choices[0].logprobs.content[0].top_logprobs[0].bytes == [72, 105]
    assert parsed.usage.prompt_tokens_details.cached_tokens == 3

    completion = CompletionResponse(
        id="cmpl-1",
        model="m",
        choices=[
            CompletionChoice(
                index=0,
                text="Hi",
                logprobs=CompletionLogprobs(
                    tokens=["Hi"],
                    token_logprobs=[-0.5],
                    top_logprobs=[{"Hi": -0.5}],
                    text_offset=[0],
                ),
                finish_reason="length",
            )
        ],
        usage=usage,
    )
    assert Completion.model_validate_json(completion.model_dump_json()).choices[0].text == "Hi"

    cards = ModelList(data=[ModelCard(id="m", root="/models/m", max_model_len=2048)])
    assert Model.model_validate(cards.model_dump()["data"][0]).id == "m"


def test_stream_deltas_leave_out_unset_fields() -> None:
    role = ChatCompletionStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))
    finish = ChatCompletionStreamChoice(index=0, delta=DeltaMessage(), finish_reason="length")
    chunk = ChatCompletionStreamResponse(id="c", model="m", choices=[role, finish])
    dumped = chunk.model_dump(exclude={"usage"})
    assert [c["delta"] for c in dumped["choices"]] == [{"role": "assistant", "content": ""}, {}]
    assert dumped["choices"][0]["finish_reason"] is None and "usage" not in dumped
    parsed = ChatCompletionChunk.model_validate_json(chunk.model_dump_json())
    assert parsed.choices[1].finish_reason == "length"
