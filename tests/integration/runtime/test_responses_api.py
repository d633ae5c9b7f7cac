"""The Responses API through the openai SDK against a real server: text, events, tools, storage."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.integration.runtime.conftest import MODEL

QUESTION = "What is the capital of France?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_a_plain_response_answers_and_counts_its_tokens(client: openai.OpenAI):
    response = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=30, temperature=0
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.error is None
    assert "Paris" in response.output_text
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "completed" and message.content[0].type == "output_text"
    usage = response.usage
    assert usage.input_tokens > 5 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # Read back whole from the store.
    again = client.responses.retrieve(response.id)
    assert again.model_dump() == response.model_dump()


def test_instructions_and_message_input_are_the_chat_prompt(client: openai.OpenAI):
    """The same conversation gives the same greedy answer through responses and chat."""
    instructions = "Answer in one short sentence."
    response = client.responses.create(
        model=MODEL,
        instructions=instructions,
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=30,
        temperature=0,
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": instructions},
            {"role": "user", "content": QUESTION},
        ],
        max_tokens=30,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.instructions == instructions


def test_a_streamed_response_sends_the_documented_events(client: openai.OpenAI):
    events = list(
        client.responses.create(
            model=MODEL, input=QUESTION, max_output_tokens=30, temperature=0, stream=True
        )
    )
    types = [e.type for e in events]
    assert types[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text and "Paris" in deltas
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == deltas and done.item_id == final.output[0].id

    plain = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=30, temperature=0
    )
    assert plain.output_text == final.output_text
    assert plain.usage.output_tokens == final.usage.output_tokens


def test_the_sdk_stream_helper_assembles_the_final_response(client: openai.OpenAI):
    with client.responses.stream(
        model=MODEL, input=QUESTION, max_output_tokens=30, temperature=0
    ) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text


def test_max_output_tokens_makes_an_incomplete_response(client: openai.OpenAI):
    response = client.responses.create(
        model=MODEL, input="Count from 1 to 100.", max_output_tokens=5, temperature=0
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5 and response.output[0].status == "incomplete"
    events = list(
        client.responses.create(
            model=MODEL,
            input="Count from 1 to 100.",
            max_output_tokens=5,
            temperature=0,
            stream=True,
        )
    )
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == response.output_text


def test_a_function_tool_call_and_its_output_continue_the_conversation(client: openai.OpenAI):
    first = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" for call in calls)
    arguments = json.loads(calls[0].arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    assert calls[0].call_id.startswith("call_") and calls[0].status == "completed"

    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}
            for call in calls
        ],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=40,
        temperature=0,
    )
    assert second.status == "completed" and second.output_text
    assert second.previous_response_id == first.id
    # The second prompt starts with the first (this model's template shows no tool calls, so
    # the calls themselves are not in it), and the engine found that part cached.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2

    # The same history given back as items (no store) gives the same answer.
    replayed = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            *[c.model_dump(include={"type", "call_id", "name", "arguments"}) for c in calls],
            *[
                {"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 24 C"}
                for c in calls
            ],
        ],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=40,
        temperature=0,
        store=False,
    )
    assert replayed.output_text == second.output_text


def test_a_named_function_streams_its_arguments(client: openai.OpenAI):
    events = list(
        client.responses.create(
            model=MODEL,
            input="Weather in Rome?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            temperature=0,
            stream=True,
        )
    )
    types = [e.type for e in events]
    assert "response.output_text.delta" not in types
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1  # streamed as generated
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == "".join(deltas) and "city" in json.loads(done.arguments)
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == done.arguments


def test_structured_output_through_text_format(client: openai.OpenAI):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "country": {"type": "string", "maxLength": 30},
        },
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL,
        input="Name a city and its country.",
        text={"format": {"type": "json_schema", "name": "place", "schema": schema}},
        max_output_tokens=60,
        temperature=0,
    )
    place = json.loads(response.output_text)
    assert set(place) == {"city", "country"}
    assert response.text.format.type == "json_schema"


def test_logprobs_are_included_when_asked_for(client: openai.OpenAI):
    response = client.responses.create(
        model=MODEL,
        input=QUESTION,
        max_output_tokens=8,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == response.usage.output_tokens
    # The tokens' bytes rebuild the text; the stop token that ended it is counted too.
    joined = bytes(b for lp in logprobs for b in lp.bytes).decode()
    assert joined in (response.output_text, response.output_text + "<|im_end|>")
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)


def test_stored_responses_are_read_deleted_and_bounded_by_store(client: openai.OpenAI):
    kept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    deleted = client.responses.delete(kept.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(kept.id)
    assert info.value.code == "response_not_found"

    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=unstored.id)
    assert info.value.code == "previous_response_not_found"
    assert info.value.param == "previous_response_id"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "gpt-4o"}, "model"),
    ],
)
def test_what_it_cannot_honour_is_a_400_naming_the_field(
    http: httpx.Client, body: dict, param: str
):
    reply = http.post("/v1/responses", json={"input": "Hi", **body})
    assert reply.status_code in (400, 404), reply.text
    error = reply.json()["error"]
    assert error["param"].split(".")[0] == param, error
