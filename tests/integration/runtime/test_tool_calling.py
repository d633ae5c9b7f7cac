"""Tool calling on a real server with the openai SDK: the embedded model, which was not trained to
call tools, makes valid calls when `tool_choice` requires one; `auto` reads a Hermes call out of
the text (here a scripted text: an EBNF grammar makes the model write it); streamed calls
accumulate in the SDK to the same calls as whole answers; a conversation with tool results
continues."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.integration.runtime.conftest import MODEL

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def calls_of(message: Any) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def streamed(client: openai.OpenAI, **kwargs: Any) -> Any:
    with client.chat.completions.stream(model=MODEL, **kwargs) as stream:
        return stream.get_final_completion().choices[0]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_makes_valid_calls_whole_and_streamed(client: openai.OpenAI, parallel: bool):
    kwargs: dict[str, Any] = {
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "parallel_tool_calls": parallel,
        "max_tokens": 200,
        "temperature": 0,
    }
    whole = client.chat.completions.create(model=MODEL, **kwargs).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    calls = calls_of(whole.message)
    assert calls and (parallel or len(calls) == 1)
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    assert all(c.id.startswith("call_") for c in whole.message.tool_calls)
    again = streamed(client, **kwargs)
    assert again.finish_reason == "tool_calls"
    assert calls_of(again.message) == calls  # greedy: the same calls, accumulated by the SDK


def test_a_named_function_gets_valid_arguments_streamed_as_they_come(client: openai.OpenAI):
    choice = {"type": "function", "function": {"name": "get_time"}}
    kwargs: dict[str, Any] = {
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": choice,
        "max_tokens": 100,
        "temperature": 0,
    }
    whole = client.chat.completions.create(model=MODEL, **kwargs).choices[0]
    ((name, arguments),) = calls_of(whole.message)
    assert name == "get_time" and whole.finish_reason == "stop"
    jsonschema.validate(arguments, SCHEMAS["get_time"])
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kwargs))
    pieces = [
        c.choices[0].delta.tool_calls[0]
        for c in chunks
        if c.choices and c.choices[0].delta.tool_calls
    ]
    assert len(pieces) > 2 and pieces[0].function.name == "get_time"
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == arguments
    assert streamed(client, **kwargs).message.tool_calls[0].function.arguments == (
        whole.message.tool_calls[0].function.arguments
    )


def test_auto_reads_a_hermes_call_out_of_the_text(client: openai.OpenAI):
    # The server runs with --tool-call-parser hermes; an EBNF grammar scripts the model's text.
    call = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    kwargs: dict[str, Any] = {
        "messages": ASK,
        "tools": [WEATHER],
        # Forced text is spelt in whatever pieces the model picks, often one character each.
        "max_tokens": 200,
        "extra_body": {"ebnf": f"root ::= {json.dumps(text)}"},
    }
    whole = client.chat.completions.create(model=MODEL, **kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content is None
    assert calls_of(whole.message) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    again = streamed(client, **kwargs)
    assert calls_of(again.message) == calls_of(whole.message) and not again.message.content
    # As OpenAI streams a call: its id and name first, then its arguments in pieces.
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kwargs))
    pieces = [
        c.choices[0].delta.tool_calls[0]
        for c in chunks
        if c.choices and c.choices[0].delta.tool_calls
    ]
    assert pieces[0].id and pieces[0].function.name == "get_weather"
    assert all(p.id is None and p.function.name is None for p in pieces[1:])
    assert len(pieces) > 2  # the arguments came as they were written
    arguments = "".join(p.function.arguments or "" for p in pieces)
    assert json.loads(arguments) == call["arguments"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [reason for reason in finishes if reason] == ["tool_calls"]
    # No call in the text: an ordinary answer, streamed as it comes.
    plain = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=12
    ).choices[0]
    assert plain.message.tool_calls is None and plain.message.content


def test_a_conversation_continues_after_tool_results(client: openai.OpenAI):
    first = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=100,
    ).choices[0]
    call = first.message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees and sunny"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=30
    ).choices[0]
    assert answer.message.content and answer.message.tool_calls is None
    assert answer.finish_reason in ("stop", "length")


def test_tool_choice_errors_are_400s_naming_the_field(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, tool_choice="required")
    assert caught.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            tool_choice="required",
            response_format={"type": "json_object"},
        )
    assert caught.value.body["param"] == "tool_choice"
