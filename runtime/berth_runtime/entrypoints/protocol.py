"""The OpenAI wire protocol: request, response and stream-chunk models of chat and completions.

Requests treat an explicit `null` as "not set" and validate the types and bounds of the fields
they know, so that a bad value is a 400 whose `param` names the field (see `validation_error`).
Every OpenAI parameter is honoured, accepted where it changes nothing here (`NO_EFFECT`: the
README lists them), or refused with a 400 naming it (`unsupported`) unless it asks for nothing
(`tools: []`, `function_call: "none"`). Fields OpenAI does not have are ignored.

Over 400 lines because it is one wire format: the shared field types and the strictness rules
above are what every model below is made of (the Responses API's own objects are in
`protocol_responses.py`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    Strict,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)

from berth_common.errors import RequestError
from berth_runtime.constrained.spec import GrammarSpec
from berth_runtime.entrypoints.tool_calls import ToolPlan, plan_tools

MAX_N = 128  # OpenAI's own bound; a server may serve fewer (--max-sequences-per-request)
MAX_STOP_STRINGS = 64
MAX_TOP_LOGPROBS = 20

# Numbers are numbers: `"0.5"` or `true` for a float is a client bug, as for an integer.
StrictFloat = Annotated[float, Strict()]
Probability = Annotated[StrictFloat, Field(ge=0.0, le=1.0)]
Penalty = Annotated[StrictFloat, Field(ge=-2.0, le=2.0)]
Bias = Annotated[StrictFloat, Field(ge=-100.0, le=100.0)]
# `"stream": "false"` is a client bug to report, not a truthy string to guess at.
StrictBool = Annotated[bool, Strict()]


# Integers a request may carry: JSON-safe ones (as JavaScript's Number.MAX_SAFE_INTEGER), which a
# JSON document, a float64 and int64 all hold exactly. Larger ones are refused with a 400.
INT_MIN, INT_MAX = -(2**53 - 1), 2**53 - 1


def json_integer(value: Any) -> Any:
    """An integer as JSON Schema counts one: `2` or `2.0`, never `"2"` or `true`; JSON-safe."""
    if isinstance(value, bool | str):
        raise ValueError("Input should be a valid integer")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not INT_MIN <= value <= INT_MAX:
        raise ValueError(f"Input should be an integer of at most 53 bits (±{INT_MAX})")
    return value


def json_integers(value: Any) -> Any:
    """`value` with every integral float (`2.0`) made an int, as JSON Schema reads numbers;
    ValueError for an integer beyond 53 bits."""
    if isinstance(value, float | int) and not isinstance(value, bool):
        return json_integer(value)
    if isinstance(value, list):
        return [json_integers(v) for v in value]
    if isinstance(value, dict):
        return {k: json_integers(v) for k, v in value.items()}
    return value


# Likewise `"n": "2"`: the document says integer, and so does parsing.
StrictInt = Annotated[int, BeforeValidator(json_integer)]
TokenId = Annotated[StrictInt, Field(ge=0)]
FinishReason = Literal["stop", "length", "tool_calls"]


def _now() -> int:
    return int(time.time())


def document_as_parsed(schema: dict[str, Any]) -> None:
    """The JSON schema says what parsing accepts: any field may be null (null is "not sent"), and
    an integer is at most 64 bits (the body guard refuses larger ones, with a 400)."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        _bound_integers(prop)
        if name in required or any(p.get("type") == "null" for p in prop.get("anyOf", ())):
            continue
        notes = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
        schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **notes}


# Pydantic leaves a bound of an optional, validator-wrapped integer in its own spelling.
_PYDANTIC_BOUNDS = {
    "ge": "minimum",
    "le": "maximum",
    "gt": "exclusiveMinimum",
    "lt": "exclusiveMaximum",
}


def _bound_integers(schema: dict[str, Any]) -> None:
    for ours, standard in _PYDANTIC_BOUNDS.items():
        if ours in schema:
            schema[standard] = schema.pop(ours)
    if schema.get("type") == "integer":
        schema.setdefault("minimum", INT_MIN)
        schema.setdefault("maximum", INT_MAX)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for sub in schema.get(key, ()):
            _bound_integers(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            _bound_integers(schema[key])


class OpenAIBaseModel(BaseModel):
    """Ignores unknown fields; an explicit `null` means the field was not sent."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=document_as_parsed)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


# --- requests -------------------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(OpenAIBaseModel):
    """`response_format.json_schema`: the schema the output must match (`strict` is how OpenAI
    asks for exactly that; here every schema is enforced, strict or not)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIBaseModel):
    """`text` (anything), `json_object` (any JSON object) or `json_schema` (that schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class FunctionCall(OpenAIBaseModel):
    """A call's function: its name and its arguments as a JSON text (OpenAI's shape)."""

    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    """One message; a list of text parts is joined with newlines into one string on input. An
    assistant message may carry the tool calls it made, and a `tool` message answers one."""

    # `developer` is OpenAI's newer name for `system` (the openai SDK's own examples send it).
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str = ""
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, content: Any) -> Any:
        if not isinstance(content, list):
            return content
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(
                    f"content parts of type {kind!r} are not supported; only text parts are"
                )
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string 'text'")
            texts.append(part["text"])
        return "\n".join(texts)


class SamplingRequest(OpenAIBaseModel):
    """Fields chat and completions share: model, sampling, stopping, streaming and routing."""

    model: str | None = None  # None: the served model
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(-1, ge=-1)  # -1 or 0: disabled
    min_p: Probability = 0.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: StrictFloat = Field(1.0, gt=0.0, le=2.0)
    logit_bias: dict[int, Bias] = {}  # JSON keys are token-id strings
    seed: Annotated[StrictInt, Field(ge=INT_MIN, le=INT_MAX)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] = []
    stop_token_ids: list[TokenId] = []
    min_tokens: StrictInt = Field(0, ge=0)
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    # Constrained output: OpenAI's response_format, or (SGLang's extensions) a regular
    # expression or an EBNF grammar; at most one of them.
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    # OpenAI parameters that change nothing here (NO_EFFECT), accepted so that clients which
    # always send them work.
    user: str | None = None
    store: StrictBool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # Berth extensions: a request id, and routing signals for the DP router.
    rid: str | None = Field(None, min_length=1)
    routed_dp_rank: Annotated[StrictInt, Field(ge=0)] | None = None
    priority: StrictInt | None = None
    routing_key: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def constraints(self) -> list[tuple[str, GrammarSpec | None]]:
        """(field, grammar) of each field that can constrain the output."""
        return [
            ("response_format", response_format_grammar(self.response_format)),
            ("regex", GrammarSpec("regex", self.regex) if self.regex is not None else None),
            ("ebnf", GrammarSpec("ebnf", self.ebnf) if self.ebnf is not None else None),
        ]

    def grammar(self) -> tuple[str, GrammarSpec] | None:
        """The field that constrains the output, and its grammar; None if none does, a 400 if
        more than one would."""
        given = [(name, spec) for name, spec in self.constraints() if spec is not None]
        if len(given) > 1:
            names = " and ".join(name for name, _ in given)
            raise RequestError(f"give at most one of {names}", param=given[1][0])
        return given[0] if given else None


# `json_object`: any JSON object, as OpenAI's JSON mode.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def response_format_grammar(response_format: ResponseFormat | None) -> GrammarSpec | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GrammarSpec("json_schema", JSON_OBJECT_SCHEMA)
    assert response_format.json_schema is not None
    return GrammarSpec("json_schema", json.dumps(response_format.json_schema.schema_))


class FunctionDefinition(OpenAIBaseModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: StrictBool | None = None


class Tool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None  # default: auto with tools, none without
    parallel_tool_calls: StrictBool = True
    # Extra variables for the chat template, e.g. {"enable_thinking": false} for Qwen3.
    chat_template_kwargs: dict[str, Any] | None = None
    # Refused unless they ask for nothing (see `unsupported`).
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None

    @field_validator(
        "functions",
        "function_call",
        "audio",
        "modalities",
        "prediction",
        "web_search_options",
        "reasoning_effort",
    )
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return unsupported(info.field_name, value)

    # Deprecated by OpenAI, still sent by many clients.
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None  # wins over max_tokens
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return top_logprobs

    @property
    def max_new_tokens(self) -> int | None:
        """The completion budget; None: up to the context limit."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def sequence_count(self) -> int:
        return self.n

    def tool_plan(self, parser: str | None = None) -> ToolPlan:
        """How this request uses its tools (`parser`: the server's --tool-call-parser)."""
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls, parser)

    def constraints(self) -> list[tuple[str, GrammarSpec | None]]:
        return [*super().constraints(), ("tool_choice", self.tool_plan().grammar())]


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
# What `_not_empty` checks, said in the OpenAPI document (a union of constrained types would
# name its members in error locations instead of `prompt`).
PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        _TOKEN_IDS,
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
    ]
}


class CompletionRequest(SamplingRequest):
    prompt: Annotated[
        str | list[str] | list[TokenId] | list[list[TokenId]], WithJsonSchema(PROMPT_SCHEMA)
    ]
    max_tokens: StrictInt = Field(16, ge=0)  # 0 with echo scores a prompt
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: StrictBool = False
    suffix: Any = None
    best_of: Annotated[StrictInt, Field(ge=1)] | None = None

    @field_validator("suffix")
    @classmethod
    def _refuse_suffix(cls, value: Any, info: ValidationInfo) -> Any:
        return unsupported(info.field_name, value)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        # best_of == n asks for nothing more than n; more would rank candidates, which this
        # server does not do.
        if best_of is not None and best_of != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported: use n")
        return best_of

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: Any) -> Any:
        prompts = _split_prompts(prompt)
        if not prompts or not all(prompts):
            raise ValueError("prompt must not be empty")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: a text or a token-id list each."""
        return _split_prompts(self.prompt)

    def sequence_count(self) -> int:
        return self.n * len(self.prompts())


def _split_prompts(prompt: Any) -> list[Any]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


# OpenAI parameters accepted with no effect here, and why (the README lists them too).
NO_EFFECT = {
    "user": "no per-user tracking or abuse monitoring",
    "store": "nothing is stored: no completions API for stored completions",
    "metadata": "only meaningful for stored completions",
    "service_tier": "one tier",
}

# What each refused parameter may be set to, because it then asks for nothing.
HARMLESS: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
    "suffix": ("",),
}


def unsupported(name: str, value: Any) -> Any:
    """Refuse a parameter this server cannot honour, unless its value asks for nothing."""
    if value in HARMLESS.get(name, ()):
        return value
    raise ValueError(f"{name} is not supported by this server")


def validation_error(errors: Sequence[Mapping[str, Any]]) -> RequestError:
    """The 400 for pydantic errors of a request body; `param` is the first offending field,
    dotted (`messages.0.content`)."""
    locs = [tuple(err["loc"])[1:] if err["loc"][:1] == ("body",) else err["loc"] for err in errors]
    details = [
        "the request has no body: send a JSON object"
        if not loc and err.get("type") == "missing"
        else f"{'.'.join(str(part) for part in loc) or 'body'}: {err['msg']}"
        for loc, err in zip(locs, errors, strict=True)
    ]
    params = [_dotted(loc) for loc in locs if loc]
    return RequestError("; ".join(details), param=params[0] if params else None)


def _dotted(loc: Sequence[Any]) -> str:
    # pydantic adds the member of a union it tried (`str`, `list[...]`) and `[key]` for a bad
    # dict key: neither is part of the field's path.
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in TYPE_NAMES))]
    return ".".join(parts)


TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "function-after"})


# --- responses ------------------------------------------------------------------------------------


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatCompletionTokenLogprob] | None = None


class ChatCompletionMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None  # None when the answer is only tool calls
    # A reasoning model's thinking (--reasoning-parser), as SGLang and vLLM return it.
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _no_empty_tool_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        for key in ("tool_calls", "reasoning_content"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class FunctionCallDelta(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _skip_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ToolCallDelta(OpenAIBaseModel):
    """A streamed part of tool call `index`: its first part has the id, type and name, later
    parts continue its arguments (the openai SDK joins them)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _skip_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaMessage(OpenAIBaseModel):
    """A stream delta; unset fields are left out, so a finish chunk's delta is `{}`."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _skip_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(OpenAIBaseModel):
    """Legacy completions logprobs; `text_offset` indexes the choice's `text` (echo included)."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamResponse(CompletionResponse):
    """One SSE chunk of a streamed completion (OpenAI uses the same object type)."""

    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "berth"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = []
