"""The clients people use, against a served engine: LangChain's ChatOpenAI (chat and Responses
API) and LiteLLM, with tools, structured output, streaming and a context overflow each."""

from __future__ import annotations

import os

import pytest
from pydantic import BaseModel, Field

from tests.helpers import RunningServer
from tests.integration.runtime.conftest import MODEL

# LiteLLM fetches its model price list from the internet at import unless told to use its own.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

langchain_openai = pytest.importorskip("langchain_openai")
litellm = pytest.importorskip("litellm")
from langchain_core.exceptions import ContextOverflowError  # noqa: E402

QUESTION = "What is the capital of France?"
TOO_LONG = "hello " * 9000  # more tokens than the 8,192 of the context


class Place(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"Sunny in {city}"


def chat_openai(server: RunningServer, **options):
    return langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=f"{server.base_url}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=40,
        max_retries=0,
        **options,
    )


@pytest.fixture
def chat_model(server: RunningServer):
    return chat_openai(server)


def test_langchain_invoke_and_stream_give_the_same_answer(chat_model):
    answer = chat_model.invoke(QUESTION)
    assert "Paris" in answer.content
    assert answer.usage_metadata["output_tokens"] > 0
    streamed = "".join(chunk.content for chunk in chat_model.stream(QUESTION))
    assert streamed == answer.content


def test_langchain_bind_tools_makes_a_tool_call(chat_model):
    with_tool = chat_model.bind_tools([get_weather], tool_choice="get_weather")
    answer = with_tool.invoke("What is the weather in Paris?")
    [call] = answer.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    assert call["id"]


def test_langchain_structured_output_is_the_model(chat_model):
    roomy = chat_model.model_copy(update={"max_tokens": 120})
    place = roomy.with_structured_output(Place).invoke("Name a city and its country.")
    assert isinstance(place, Place) and place.city and place.country


def test_langchain_context_overflow_raises_context_overflow_error(chat_model):
    with pytest.raises(ContextOverflowError):
        chat_model.invoke(TOO_LONG)


def test_langchain_on_the_responses_api(server: RunningServer, chat_model):
    responses_model = chat_openai(server, use_responses_api=True)
    answer = responses_model.invoke(QUESTION)
    assert answer.text == chat_model.invoke(QUESTION).content
    streamed = "".join(chunk.text for chunk in responses_model.stream(QUESTION))
    assert streamed == answer.text
    with_tool = responses_model.bind_tools([get_weather], tool_choice="get_weather")
    [call] = with_tool.invoke("What is the weather in Paris?").tool_calls
    assert call["name"] == "get_weather" and "city" in call["args"]


def litellm_args(server: RunningServer) -> dict:
    return {
        "model": f"openai/{MODEL}",
        "api_base": f"{server.base_url}/v1",
        "api_key": "unused",
        "temperature": 0,
        "max_tokens": 40,
        "num_retries": 0,
    }


def test_litellm_completion_stream_and_tools(server: RunningServer):
    args = litellm_args(server)
    messages = [{"role": "user", "content": QUESTION}]
    answer = litellm.completion(messages=messages, **args)
    text = answer.choices[0].message.content
    assert "Paris" in text and answer.usage.completion_tokens > 0
    chunks = litellm.completion(messages=messages, stream=True, **args)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    called = litellm.completion(
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **args,
    )
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather"


def test_litellm_context_overflow_is_its_context_window_error(server: RunningServer):
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(messages=[{"role": "user", "content": TOO_LONG}], **litellm_args(server))
