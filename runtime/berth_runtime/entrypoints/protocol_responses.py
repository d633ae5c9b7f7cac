"""The Responses API's wire protocol: `POST /v1/responses` bodies, and the response objects.

A request is read into chat messages (`ResponsesRequest.messages`), so that the Responses API
runs on the same template, sampling, constrained decoding and tool calling as chat. What it cannot
honour is a 400 naming the field: built-in tools (web search, files, MCP, ...), `background`,
`conversation`, `prompt` templates, `reasoning`, `max_tool_calls`, `truncation: "auto"`, and
input items other than messages, function calls and their outputs. The README lists them.
(Just over 400 lines: request and response objects of one API, read together.)
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import (
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from berth_runtime.constrained.spec import GrammarSpec
from berth_runtime.entrypoints.protocol import (
    JSON_OBJECT_SCHEMA,
    MAX_TOP_LOGPROBS,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    NamedToolChoice,
    OpenAIBaseModel,
    SamplingRequest,
    StrictBool,
    StrictInt,
    Tool,
    ToolCall,
    ToolChoiceFunction,
    unsupported,
)
from berth_runtime.entrypoints.tool_calls import ToolPlan, plan_tools

# What `include` may ask for: the logprobs of the output text.
OUTPUT_LOGPROBS = "message.output_text.logprobs"
# Text parts a message may carry (a refusal given back as input is text too).
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def _joined_text(content: Any) -> Any:
    """Content given as text parts, as one string; other parts (images, files) are refused."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in TEXT_PARTS:
            raise ValueError(f"content parts of type {kind!r} are not supported; only text is")
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"a {kind} part needs a string")
        texts.append(text)
    return "\n".join(texts)


# --- input items ----------------------------------------------------------------------------------


class MessageItem(OpenAIBaseModel):
    """A message of the conversation (`type` may be left out, as OpenAI allows)."""

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, content: Any) -> Any:
        return _joined_text(content)


class FunctionCallItem(OpenAIBaseModel):
    """A call the model made earlier, given back as history."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(OpenAIBaseModel):
    """What the client's function returned for a call."""

    type: Literal["function_call_output"]
    call_id: str
    output: str

    @field_validator("output", mode="before")
    @classmethod
    def _text(cls, output: Any) -> Any:
        return _joined_text(output)


class ReasoningItem(OpenAIBaseModel):
    """A reasoning item of an earlier response, given back with its output (as agent SDKs do):
    accepted, and not shown to the model again (chat templates drop past thinking too)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = []
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_type(item: Any) -> str:
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


def chat_messages(items: list[InputItem]) -> list[ChatMessage]:
    """Input items as chat messages: a function call joins the assistant message before it (or
    starts one), its output is a `tool` message; a reasoning item is left out."""
    messages: list[ChatMessage] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role, content=item.content))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(
                id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
            )
            last = messages[-1] if messages else None
            if last is None or last.role != "assistant":
                last = ChatMessage(role="assistant", content="")
                messages.append(last)
            last.tool_calls = [*(last.tool_calls or []), call]
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(
                ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id)
            )
    return messages


# --- request --------------------------------------------------------------------------------------


class FunctionTool(OpenAIBaseModel):
    """A function the model may call (the Responses API's flat shape)."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    def as_chat_tool(self) -> Tool:
        return Tool(
            type="function",
            function=FunctionDefinition(
                name=self.name,
                description=self.description,
                parameters=self.parameters,
                strict=self.strict,
            ),
        )


class FunctionToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIBaseModel):
    """`text.format`: plain text, any JSON object, or JSON matching `schema`."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a json_schema format needs a schema")
        return self

    def grammar(self) -> GrammarSpec | None:
        if self.type == "json_object":
            return GrammarSpec("json_schema", JSON_OBJECT_SCHEMA)
        if self.type == "json_schema":
            return GrammarSpec("json_schema", json.dumps(self.schema_))
        return None


class TextConfig(OpenAIBaseModel):
    format: TextFormat = TextFormat()
    verbosity: str | None = None  # a hint for reasoning models; nothing here


class ResponsesRequest(SamplingRequest):
    """`POST /v1/responses`. The sampling fields chat has (`stop`, `seed`, penalties, ...) are
    read too, as Berth extensions; `n` stays 1."""

    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] = []
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    previous_response_id: str | None = None
    store: StrictBool = True
    text: TextConfig = TextConfig()
    include: list[str] = []
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    truncation: Literal["disabled", "auto"] = "disabled"
    # Accepted with no effect, as on chat (NO_EFFECT): user, metadata, service_tier; and these.
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Refused unless they ask for nothing.
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    max_tool_calls: Any = None
    response_format: Any = None  # chat's field: here it is `text.format`

    @field_validator("tools", mode="before")
    @classmethod
    def _only_function_tools(cls, tools: Any) -> Any:
        for tool in tools if isinstance(tools, list) else []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(
                    f"tools of type {kind!r} are not supported by this server; only function "
                    "tools are"
                )
        return tools

    @field_validator("n")
    @classmethod
    def _one_answer(cls, n: int) -> int:
        if n != 1:
            raise ValueError("the Responses API makes one answer: n must be 1")
        return n

    @field_validator("include")
    @classmethod
    def _known_includes(cls, include: list[str]) -> list[str]:
        for name in include:
            if name != OUTPUT_LOGPROBS:
                raise ValueError(f"include {name!r} is not supported; only {OUTPUT_LOGPROBS!r}")
        return include

    @field_validator("truncation")
    @classmethod
    def _no_auto_truncation(cls, truncation: str) -> str:
        if truncation == "auto":
            raise ValueError(
                "truncation 'auto' is not supported: a conversation longer than the context is "
                "refused with context_length_exceeded"
            )
        return truncation

    @field_validator(
        "background",
        "conversation",
        "prompt",
        "reasoning",
        "max_tool_calls",
        "response_format",
    )
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value in (False, {}) or value == {"effort": None, "summary": None}:
            return value  # asks for nothing
        if info.field_name == "response_format":
            raise ValueError("response_format is chat's parameter: here it is text.format")
        return unsupported(info.field_name, value)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_output_tokens

    @property
    def logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in self.include

    def sequence_count(self) -> int:
        return 1

    def chat_tools(self) -> list[Tool]:
        return [tool.as_chat_tool() for tool in self.tools]

    def tool_plan(self, parser: str | None = None) -> ToolPlan:
        choice = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            choice = NamedToolChoice(type="function", function=ToolChoiceFunction(name=choice.name))
        return plan_tools(self.chat_tools(), choice, self.parallel_tool_calls, parser)

    def constraints(self) -> list[tuple[str, GrammarSpec | None]]:
        return [
            ("text.format", self.text.format.grammar()),
            ("regex", GrammarSpec("regex", self.regex) if self.regex is not None else None),
            ("ebnf", GrammarSpec("ebnf", self.ebnf) if self.ebnf is not None else None),
            ("tool_choice", self.tool_plan().grammar()),
        ]

    def input_messages(self) -> list[ChatMessage]:
        """This request's own input, as chat messages (without instructions or history)."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        return chat_messages(self.input)


# --- response objects -----------------------------------------------------------------------------


class LogprobAlternative(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int]


class OutputLogprob(LogprobAlternative):
    top_logprobs: list[LogprobAlternative] = []


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = []
    logprobs: list[OutputLogprob] = []


class OutputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = []


class OutputFunctionCall(OpenAIBaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class OutputReasoning(OpenAIBaseModel):
    """A reasoning model's thinking (--reasoning-parser), before its answer."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = []
    content: list[ReasoningText] = []
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int = 0


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(OpenAIBaseModel):
    code: str
    message: str


class ResponseObject(OpenAIBaseModel):
    """A response, as `POST /v1/responses` returns it and `GET /v1/responses/{id}` again."""

    id: str
    object: Literal["response"] = "response"
    created_at: float = Field(default_factory=time.time)
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    model: str
    output: list[OutputItem] = []
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int = 0
    tools: list[FunctionTool] = []
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    text: TextConfig = TextConfig()
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str] = {}
    user: str | None = None
    background: bool = False
    service_tier: str = "default"


class DeletedResponse(OpenAIBaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
