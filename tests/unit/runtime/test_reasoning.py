"""--reasoning-parser: thinking split from the answer, whole and however the text is streamed;
then through the chat endpoint (a scripted TokenizerManager, the openai SDK) and the Responses
API's builder, with fixed outputs: a tiny model's text is noise, the parsing is what is tested."""

from __future__ import annotations

import copy
import json
import random

import httpx
import pytest
from openai import AsyncOpenAI

from berth_runtime.entrypoints.protocol_responses import ResponseObject
from berth_runtime.entrypoints.reasoning import (
    REASONING_PARSERS,
    ReasoningStream,
    prompt_opens_thinking,
    split_reasoning,
)
from berth_runtime.entrypoints.serving_responses import ResponseBuilder
from berth_runtime.entrypoints.tool_calls import ToolPlan
from berth_runtime.io_struct import FinishReason, RequestOutput
from berth_runtime.server_args import ServerArgs
from tests.unit.runtime.fakes import MODEL, FakeTokenizerManager

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek-r1"]
USER = [{"role": "user", "content": "Capital of France?"}]


@pytest.mark.parametrize(
    ("fmt", "text", "prompt_opened", "expected"),
    [
        (QWEN3, "<think>\nParis is it.\n</think>\n\nParis.", False, ("Paris is it.", "Paris.")),
        (QWEN3, "Paris.", False, (None, "Paris.")),  # no thinking at all
        (QWEN3, "  <think>x</think>y", False, ("x", "y")),
        (QWEN3, "Paris is it.</think>\n\nParis.", True, ("Paris is it.", "Paris.")),
        (QWEN3, "<think>\nStill thinking", False, ("Still thinking", None)),  # cut off
        (R1, "Paris is it.\n</think>\n\nParis.", False, ("Paris is it.", "Paris.")),
        (R1, "<think>Paris is it.</think>Paris.", True, ("Paris is it.", "Paris.")),
        (R1, "Hmm, the capital", False, ("Hmm, the capital", None)),
        (QWEN3, "<thinking> is a word", False, (None, "<thinking> is a word")),
    ],
)
def test_a_whole_output_splits_into_thinking_and_answer(fmt, text, prompt_opened, expected):
    assert split_reasoning(fmt, text, prompt_opened) == expected


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        (QWEN3, "<think>\nLet me see: 2 < 3.\n</think>\n\nYes, 2 < 3."),
        (QWEN3, "No thinking here, just </think> text"),
        (R1, "Step one.</think>Done."),
    ],
)
def test_streamed_deltas_add_up_to_the_whole_split_however_the_text_is_cut(seed, fmt, text):
    cuts = sorted(random.Random(seed).sample(range(1, len(text)), 6))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream = ReasoningStream(fmt, prompt_opened=False)
    thinking = answer = ""
    for piece in pieces:
        more_thinking, more_answer = stream.feed(piece)
        thinking, answer = thinking + more_thinking, answer + more_answer
    rest_thinking, rest_answer = stream.finish()
    thinking, answer = thinking + rest_thinking, answer + rest_answer
    whole_thinking, whole_answer = split_reasoning(fmt, text, prompt_opened=False)
    assert (thinking.strip() or None, answer or None) == (whole_thinking, whole_answer)
    assert "<think>" not in thinking and "</think>" not in thinking


def test_the_prompt_tail_tells_whether_the_template_opened_the_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")  # DeepSeek-R1, QwQ
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # off
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


# --- the chat endpoint ---------------------------------------------------------------------------

# A Qwen3-like template: `enable_thinking: false` closes an empty think block in the prompt.
QWEN3_LIKE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


@pytest.fixture
def thinking_tm(tm: FakeTokenizerManager) -> FakeTokenizerManager:
    tm.tokenizer = copy.copy(tm.tokenizer)
    tm.tokenizer.chat_template = QWEN3_LIKE_TEMPLATE
    tm.args = ServerArgs(reasoning_parser="qwen3")
    return tm


async def test_chat_returns_the_thinking_as_reasoning_content_whole_and_streamed(
    http: httpx.AsyncClient, thinking_tm: FakeTokenizerManager
) -> None:
    thinking_tm.reply = lambda obj: "<think>\nThe capital is Paris.\n</think>\n\nParis."
    body = {"model": MODEL, "messages": USER}
    message = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "The capital is Paris."
    assert message["content"] == "Paris."

    response = await http.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [
        json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
        for line in response.text.splitlines()
        if line.startswith("data: {")
    ]
    deltas = [d for d in deltas if d]  # the finish chunk's delta is {}
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert reasoning.strip() == "The capital is Paris." and content == "Paris."
    assert not any("reasoning_content" in d and "content" in d for d in deltas)  # apart
    assert all("<think>" not in d.get("content", "") for d in deltas)


async def test_enable_thinking_false_reaches_the_template_and_the_answer_is_content(
    sdk: AsyncOpenAI, thinking_tm: FakeTokenizerManager
) -> None:
    thinking_tm.reply = lambda obj: "Paris."
    reply = await sdk.chat.completions.create(
        model=MODEL, messages=USER, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    prompt = thinking_tm.tokenizer.decode(thinking_tm.received[-1].input_ids)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert reply.choices[0].message.content == "Paris."
    assert getattr(reply.choices[0].message, "reasoning_content", None) is None


async def test_a_prompt_that_opens_the_thinking_makes_the_output_start_in_it(
    sdk: AsyncOpenAI, thinking_tm: FakeTokenizerManager
) -> None:
    thinking_tm.tokenizer.chat_template = QWEN3_LIKE_TEMPLATE.replace(
        "<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n"
    )
    thinking_tm.reply = lambda obj: "France's capital: Paris.</think>\n\nParis."
    reply = await sdk.chat.completions.create(model=MODEL, messages=USER)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == ("France's capital: Paris.", "Paris.")


async def test_tool_calls_after_the_thinking_are_still_tool_calls(
    sdk: AsyncOpenAI, thinking_tm: FakeTokenizerManager
) -> None:
    thinking_tm.args = ServerArgs(reasoning_parser="qwen3", tool_call_parser="hermes")
    thinking_tm.reply = lambda obj: (
        '<think>Need the weather.</think>\n<tool_call>{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}</tool_call>'
    )
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    reply = await sdk.chat.completions.create(model=MODEL, messages=USER, tools=[tool])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "Need the weather."
    assert choice.message.tool_calls[0].function.name == "get_weather"


@pytest.mark.parametrize("key", ["tokenize", "chat_template", "add_generation_prompt"])
async def test_chat_template_kwargs_may_not_set_the_template_calls_own_arguments(
    http: httpx.AsyncClient, key: str
) -> None:
    body = {"model": MODEL, "messages": USER, "chat_template_kwargs": {key: "x"}}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template_kwargs"


# --- the Responses API ---------------------------------------------------------------------------


def test_a_response_has_a_reasoning_item_before_its_message() -> None:
    builder = ResponseBuilder(
        ResponseObject(id="resp_1", model=MODEL),
        ToolPlan("none"),
        logprobs=False,
        thinking=ReasoningStream(QWEN3, prompt_opened=False),
    )
    events = builder.opening()
    pieces = ["<thi", "nk>Paris, ", "surely.</th", "ink>\n\nPar", "is."]
    for position, piece in enumerate(pieces):
        last = position == len(pieces) - 1
        out = RequestOutput(
            rid="r",
            text=piece,
            token_ids=[1],
            finish_reason=FinishReason("stop", matched_token=2) if last else None,
            prompt_tokens=5,
            completion_tokens=position + 1,
        )
        events += builder.advance(out)
    kinds = [e["type"] for e in events]
    thought = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    reasoning_delta = "".join(thought)
    assert reasoning_delta == "Paris, surely."
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    reasoning, message = builder.response.output
    assert reasoning.type == "reasoning" and reasoning.status == "completed"
    assert reasoning.content[0].text == "Paris, surely."
    assert message.type == "message" and message.content[0].text == "Paris."
    assert kinds[-1] == "response.completed"
