"""Tool calling: plans, grammars and parsers on their own, then the chat endpoint over a scripted
TokenizerManager with the openai SDK, whole and streamed (the SDK accumulates the deltas)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai import AsyncOpenAI

from berth_common.errors import RequestError
from berth_runtime.constrained.grammar import check_grammar
from berth_runtime.entrypoints.protocol import ChatCompletionRequest
from berth_runtime.entrypoints.protocol_responses import ResponseObject
from berth_runtime.entrypoints.serving_responses import ResponseBuilder
from berth_runtime.entrypoints.tool_calls import detect_parser, effective_parser, plan_tools
from berth_runtime.entrypoints.tool_parsers import ParsedCall, read_calls
from berth_runtime.entrypoints.tool_stream import CallPiece, ToolStream
from berth_runtime.io_struct import FinishReason, RequestOutput
from tests.unit.runtime.fakes import MODEL, FakeTokenizerManager

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def plan_of(tools: list[dict], tool_choice: Any = None, parser: str | None = "hermes", **more):
    request = ChatCompletionRequest(messages=USER, tools=tools, tool_choice=tool_choice, **more)
    return request.tool_plan(parser)


# --- plans and grammars --------------------------------------------------------------------------


def test_the_default_choice_is_auto_with_tools_and_none_without():
    assert plan_of([WEATHER]).mode == "auto"
    assert ChatCompletionRequest(messages=USER).tool_plan().mode == "none"
    assert plan_of([WEATHER], parser=None).parses is False  # auto without a parser: text


@pytest.mark.parametrize(
    ("tools", "choice", "message"),
    [
        ([], "required", "needs tools"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not in tools"),
    ],
)
def test_a_choice_that_cannot_be_met_is_a_400_naming_tool_choice(tools, choice, message):
    with pytest.raises(RequestError) as caught:
        plan_of(tools, choice)
    assert caught.value.param == "tool_choice" and message in str(caught.value)
    with pytest.raises(RequestError) as caught:
        plan_tools(
            ChatCompletionRequest(messages=USER, tools=[WEATHER, WEATHER]).tools, None, True, None
        )
    assert caught.value.param == "tools"


def test_required_and_named_choices_are_grammars_the_engine_accepts():
    required = plan_of([WEATHER, TIME], "required").grammar()
    assert required is not None and required.kind == "json_schema"
    schema = json.loads(required.source)
    assert schema["minItems"] == 1 and "maxItems" not in schema
    names = [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    single = json.loads(plan_of([WEATHER], "required", parallel_tool_calls=False).grammar().source)
    assert single["maxItems"] == 1
    named = plan_of([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert json.loads(named.grammar().source)["properties"] == {}  # no parameters: `{}`
    for plan in (plan_of([WEATHER], "required"), named):
        check_grammar(plan.grammar())  # parses in xgrammar


# --- reading calls back --------------------------------------------------------------------------


def test_hermes_calls_and_the_text_before_them():
    plan = plan_of([WEATHER, TIME])
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    content, calls = read_calls(plan, text)
    assert content == "Let me check."
    assert calls == [
        ParsedCall("get_weather", '{"city": "Paris"}'),
        ParsedCall("get_time", "{}"),
    ]
    assert read_calls(plan, "No tools needed.") == ("No tools needed.", [])
    broken = '<tool_call>{"name": "get_weather", "arguments": </tool_call>'
    assert read_calls(plan, broken) == (broken, [])


def test_llama3_calls_with_or_without_the_python_tag():
    plan = plan_of([WEATHER, TIME], parser="llama3")
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "parameters": {}}'
    )
    assert read_calls(plan, text) == (
        None,
        [ParsedCall("get_weather", '{"city": "Oslo"}'), ParsedCall("get_time", "{}")],
    )
    assert read_calls(plan, "It is sunny.") == ("It is sunny.", [])


def test_mistral_calls_as_a_json_array_or_name_then_args():
    plan = plan_of([WEATHER, TIME], parser="mistral")
    array = (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Nice"}}, '
        '{"name": "get_time", "arguments": {}}]'
    )
    both = [ParsedCall("get_weather", '{"city": "Nice"}'), ParsedCall("get_time", "{}")]
    assert read_calls(plan, array) == (None, both)
    # Mistral's newer tokenizers (v11+): [TOOL_CALLS]name[ARGS]{...}, one tag per call.
    named = '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}[TOOL_CALLS]get_time[ARGS]{}'
    assert read_calls(plan, "Checking. " + named) == ("Checking.", both)
    for broken in ('[TOOL_CALLS][{"name": "get_weather"', "[TOOL_CALLS]get_weather{}", "Hi."):
        assert read_calls(plan, broken) == (broken, [])


def test_a_mistral_stream_holds_back_from_its_tag():
    stream = ToolStream(plan_of([WEATHER], parser="mistral"))
    assert stream.feed("Let me see [TOOL") == ("Let me see", [])
    content, (piece,) = stream.feed('_CALLS][{"name": "get_weather", "arguments": {"city": ')
    assert content == "" and (piece.index, piece.name, piece.arguments) == (
        0,
        "get_weather",
        '{"city": ',
    )
    assert stream.feed('"Metz"}}]') == ("", [CallPiece(0, '"Metz"}')])
    assert stream.end(clean=True) == ("", [])


# Lines of the chat templates of the families, enough to tell their tool-call format.
QWEN3_TEMPLATE = 'For each call: <tool_call>{"name": <function-name>, "arguments": ...}</tool_call>'
MISTRAL_TEMPLATE = "{%- if message.tool_calls %}{{- '[TOOL_CALLS][' }}{%- endif %}"
LLAMA31_TEMPLATE = (
    'Respond in the format {"name": function name, "parameters": dictionary of argument name '
    "and its value}."
)


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        (QWEN3_TEMPLATE, "hermes"),
        (MISTRAL_TEMPLATE, "mistral"),
        (LLAMA31_TEMPLATE, "llama3"),
        ("{{ '<|python_tag|>' + tool_call.name }}", "llama3"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", None),  # SmolLM2: no tools
        (None, None),
    ],
)
def test_the_parser_follows_the_chat_template_unless_the_flag_names_one(template, parser):
    assert detect_parser(template) == parser
    assert effective_parser(None, template) == parser
    assert effective_parser("llama3", template) == "llama3"
    assert effective_parser("none", template) is None


def test_a_hermes_stream_sends_text_and_holds_back_what_may_start_a_call():
    stream = ToolStream(plan_of([WEATHER]))
    assert stream.feed("Sure, ") == ("Sure,", [])  # the space waits for what follows it
    assert stream.feed("one moment <to") == (" one moment", [])  # "<to" may begin "<tool_call>"
    assert stream.feed("ol_call>") == ("", [])
    content, pieces = stream.feed('{"name": "get_weather", "arguments": {"city": "Rome"}}')
    assert content == "" and [(p.name, p.arguments) for p in pieces] == [
        ("get_weather", '{"city": "Rome"}')
    ]
    assert stream.feed("</tool_call>") == ("", [])
    assert stream.end(clean=True) == ("", [])
    plain = ToolStream(plan_of([WEATHER]))
    assert plain.feed("I think <b> ") == ("I think <b>", [])  # not a call's start: sent at once
    assert plain.end(clean=True) == (" ", [])


# Replies cut into pieces at every character: what a stream sends must add up to the whole reply.
STREAMED_REPLIES = [
    (
        "hermes",
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"Nord\\"",'
        ' "unit": "C"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
        "</tool_call>",
    ),
    ("hermes", '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_time"}</tool_call>'),
    ("hermes", "A <b>bold</b> answer with no call."),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": 1}"}</tool_call>'),
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "parameters": {}}',
    ),
    ("llama3", "{curly} but not a call"),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Nice"}}, '
        '{"name": "get_time", "arguments": {}}]',
    ),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}[TOOL_CALLS]get_time[ARGS]{}'),
    (
        None,  # tool_choice: required
        '[{"name": "get_weather", "parameters": {"city": "Nice"}}, '
        '{"name": "get_time", "parameters": {}}]',
    ),
]


@pytest.mark.parametrize(("parser", "reply"), STREAMED_REPLIES)
def test_a_streamed_reply_adds_up_to_the_whole_one_however_it_is_cut(parser, reply):
    plan = plan_of([WEATHER, TIME], "required" if parser is None else None, parser=parser)
    content, calls = read_calls(plan, reply)
    for size in (1, 2, 3, 7, len(reply)):
        stream = ToolStream(plan)
        streamed_content = ""
        pieces: list[CallPiece] = []
        for start in range(0, len(reply), size):
            more_content, more_pieces = stream.feed(reply[start : start + size])
            streamed_content += more_content
            pieces += more_pieces
        rest, last = stream.end(clean=True)
        streamed_content, pieces = streamed_content + rest, pieces + last
        streamed: dict[int, list[str]] = {}
        for piece in pieces:
            if piece.call_id is not None:  # a call's first piece: exactly one, before the rest
                assert piece.index == len(streamed) and piece.name is not None
                streamed[piece.index] = [piece.name, ""]
            streamed[piece.index][1] += piece.arguments
        assert [ParsedCall(*call) for call in streamed.values()] == calls
        assert (streamed_content.strip() or None) == (content.strip() if content else None)


def test_a_call_streams_its_name_first_then_its_arguments_as_they_are_written():
    stream = ToolStream(plan_of([WEATHER]))
    reply = '<tool_call>{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "C"}}'
    seen = [stream.feed(reply[: reply.index('{"city')])]
    assert seen[0] == ("", [])  # the name alone: the call waits for its arguments to open
    for start in range(reply.index('{"city'), len(reply), 4):
        seen.append(stream.feed(reply[start : start + 4]))
    first = seen[1][1][0]
    assert first.call_id and first.name == "get_weather" and first.arguments == '{"ci'
    assert sum(1 for _, pieces in seen for _ in pieces) > 5  # the arguments came in pieces


def test_a_cut_off_call_ends_with_what_was_written_and_plain_text_with_all_of_it():
    stream = ToolStream(plan_of([WEATHER]))
    stream.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Ly')
    assert stream.end(clean=False) == ("", [])  # committed: no more pieces, no content
    held = ToolStream(plan_of([WEATHER]))
    assert held.feed('Hm <tool_call>{"name": "get_wea') == ("Hm", [])
    assert held.end(clean=False) == (' <tool_call>{"name": "get_wea', [])


# --- the endpoint, with the openai SDK -----------------------------------------------------------


async def test_auto_with_a_hermes_reply_is_a_tool_call_whole_and_streamed(
    sdk: AsyncOpenAI, tm: FakeTokenizerManager
) -> None:
    tm.reply = lambda obj: (
        'I will look.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    whole = await sdk.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    async with sdk.chat.completions.stream(model=MODEL, messages=USER, tools=[WEATHER]) as s:
        final = await s.get_final_completion()
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert streamed.message.content == "I will look."
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (call.function.name, call.function.arguments)
    ]


async def test_a_named_choice_streams_its_arguments_as_they_come(
    sdk: AsyncOpenAI, tm: FakeTokenizerManager
) -> None:
    tm.reply = lambda obj: '{"city": "Lyon", "unit": "C"}'
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = await sdk.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER], tool_choice=choice
    )
    assert whole.choices[0].finish_reason == "stop"  # as OpenAI: a forced call ends with stop
    assert whole.choices[0].message.content is None
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Lyon", "unit": "C"}
    # The grammar reached the engine: the function's parameters schema.
    sent = json.loads(tm.received[-1].sampling_params.json_schema)
    assert sent == WEATHER["function"]["parameters"]

    chunks = [
        c
        async for c in await sdk.chat.completions.create(
            model=MODEL, messages=USER, tools=[WEATHER], tool_choice=choice, stream=True
        )
    ]
    deltas = [
        c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls
    ]
    assert len(deltas) > 2  # the arguments came in pieces
    assert deltas[0][0].id and deltas[0][0].function.name == "get_weather"
    assert "".join(d[0].function.arguments or "" for d in deltas) == '{"city": "Lyon", "unit": "C"}'


async def test_required_sends_the_array_grammar_and_reads_every_call(
    sdk: AsyncOpenAI, tm: FakeTokenizerManager
) -> None:
    tm.reply = lambda obj: (
        '[{"name": "get_weather", "parameters": {"city": "Nice"}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    whole = await sdk.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER, TIME], tool_choice="required"
    )
    calls = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Nice"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2
    async with sdk.chat.completions.stream(
        model=MODEL, messages=USER, tools=[WEATHER, TIME], tool_choice="required"
    ) as s:
        final = await s.get_final_completion()
    assert [
        (c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls
    ] == [(c.function.name, c.function.arguments) for c in calls]


async def test_history_with_tool_calls_and_tool_answers_renders_through_the_template(
    sdk: AsyncOpenAI, tm: FakeTokenizerManager
) -> None:
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    tm.reply = lambda obj: "It is 18 C and sunny in Paris."
    answer = await sdk.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert answer.choices[0].message.content == "It is 18 C and sunny in Paris."
    assert answer.choices[0].finish_reason == "stop"
    prompt = tm.tokenizer.decode(tm.received[-1].input_ids)
    assert "18 C and sunny" in prompt


def test_a_response_streams_a_hermes_call_after_closing_its_message() -> None:
    plan = plan_of([WEATHER])
    builder = ResponseBuilder(ResponseObject(id="resp_1", model=MODEL), plan, logprobs=False)
    reply = (
        'Looking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Metz"}}</tool_call>'
    )
    events = builder.opening()
    for start in range(0, len(reply), 5):
        last = start + 5 >= len(reply)
        out = RequestOutput(
            rid="r",
            text=reply[start : start + 5],
            token_ids=[1],
            finish_reason=FinishReason("stop", matched_token=2) if last else None,
            prompt_tokens=5,
            completion_tokens=start + 1,
        )
        events += builder.advance(out)
    kinds = [e["type"] for e in events]
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["message", "function_call"]
    # The message is done before the call is added; the call's arguments stream in pieces.
    assert kinds.index("response.output_text.done") < kinds.index("response.output_item.added", 3)
    arguments = [
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
    ]
    assert len(arguments) > 2 and "".join(arguments) == '{"city": "Metz"}'
    message, call = builder.response.output
    assert message.content[0].text == "Looking."
    assert (call.name, call.arguments, call.status) == (
        "get_weather",
        '{"city": "Metz"}',
        "completed",
    )
    assert kinds[-1] == "response.completed"
