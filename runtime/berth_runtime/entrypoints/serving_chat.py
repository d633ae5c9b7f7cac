"""POST /v1/chat/completions: apply the chat template, run the choices, answer JSON or SSE."""

from __future__ import annotations

import functools
import inspect
import json
from functools import partial
from typing import Any

import jinja2
import msgspec
from fastapi import Request

from berth_common.errors import RequestError
from berth_runtime.entrypoints.protocol import (
    ChatCompletionChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatCompletionTokenLogprob,
    ChatMessage,
    ChoiceLogprobs,
    DeltaMessage,
    FunctionCall,
    FunctionCallDelta,
    Tool,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    UsageInfo,
)
from berth_runtime.entrypoints.reasoning import (
    REASONING_PARSERS,
    ReasoningFormat,
    ReasoningStream,
    prompt_opens_thinking,
    split_reasoning,
)
from berth_runtime.entrypoints.serving_base import (
    EngineClient,
    OpenAIServingBase,
    Output,
    choice_inputs,
    finish_reason,
    finite,
    sampling_params,
    usage_info,
)
from berth_runtime.entrypoints.tool_calls import ToolPlan, effective_parser
from berth_runtime.entrypoints.tool_parsers import read_calls
from berth_runtime.entrypoints.tool_stream import ToolStream, new_call_id
from berth_runtime.io_struct import GenerateReqInput


class OpenAIServingChat(OpenAIServingBase[ChatCompletionRequest]):
    """Chat completions: one templated prompt, `n` choices."""

    id_prefix = "chatcmpl"

    def build_inputs(
        self, request: ChatCompletionRequest, raw_request: Request, base_rid: str
    ) -> list[GenerateReqInput]:
        prompt = chat_prompt_ids(
            self.tokenizer_manager, request.messages, request.tools, request.chat_template_kwargs
        )
        return choice_inputs(
            request,
            raw_request,
            [prompt],
            base_rid,
            sampling_params(request, request.max_new_tokens),
            return_logprob=request.logprobs,
            top_logprobs_num=request.top_logprobs or 0,
        )

    def chunker(
        self, request: ChatCompletionRequest, response_id: str, reqs: list[GenerateReqInput]
    ) -> ChatChunker:
        model = request.model or self.tokenizer_manager.model_name
        plan = request.tool_plan(tool_call_parser(self.tokenizer_manager))
        thinking = Thinking.of(self.tokenizer_manager, reqs)
        return ChatChunker(response_id, model, len(reqs), request.logprobs, plan, thinking)

    def build_response(
        self,
        request: ChatCompletionRequest,
        response_id: str,
        reqs: list[GenerateReqInput],
        outputs: list[Output],
    ) -> ChatCompletionResponse:
        plan = request.tool_plan(tool_call_parser(self.tokenizer_manager))
        thinking = Thinking.of(self.tokenizer_manager, reqs)
        choices = []
        for index, out in enumerate(outputs):
            message, reason = answer(plan, out, thinking.split(index, out.text))
            choices.append(
                ChatCompletionChoice(
                    index=index,
                    message=message,
                    logprobs=chat_logprobs(out) if request.logprobs else None,
                    finish_reason=reason,
                )
            )
        return ChatCompletionResponse(
            id=response_id,
            model=request.model or self.tokenizer_manager.model_name,
            choices=choices,
            usage=usage_info(outputs, request.n),
        )


def tool_call_parser(engine: EngineClient) -> str | None:
    """The server's tool-call parser: --tool-call-parser's, or the chat template's format."""
    return effective_parser(engine.args.tool_call_parser, engine.tokenizer.chat_template)


# Prompt tokens decoded to see whether the template left a `<think>` open: the generation prompt
# is the template's last few tokens.
PROMPT_TAIL_TOKENS = 16


class Thinking:
    """--reasoning-parser for one request: its format and, for each choice, whether the prompt
    opened the thinking."""

    def __init__(self, fmt: ReasoningFormat | None, opened: list[bool]) -> None:
        self.fmt = fmt
        self.opened = opened

    @classmethod
    def of(cls, engine: EngineClient, reqs: list[GenerateReqInput]) -> Thinking:
        name = engine.args.reasoning_parser
        if name is None:
            return cls(None, [False] * len(reqs))
        # Every choice of a chat request has the same prompt: decode its tail once.
        tail = engine.tokenizer.decode((reqs[0].input_ids or [])[-PROMPT_TAIL_TOKENS:])
        return cls(REASONING_PARSERS[name], [prompt_opens_thinking(tail)] * len(reqs))

    def split(self, index: int, text: str) -> tuple[str | None, str]:
        """A whole choice's (thinking, answer); without a parser, all is the answer."""
        if self.fmt is None:
            return None, text
        reasoning, answer_text = split_reasoning(self.fmt, text, self.opened[index])
        return reasoning, answer_text or ""

    def streams(self) -> list[ReasoningStream] | None:
        if self.fmt is None:
            return None
        return [ReasoningStream(self.fmt, opened) for opened in self.opened]


@functools.cache
def reserved_template_kwargs(tokenizer_class: type) -> frozenset[str]:
    """The arguments of `apply_chat_template` itself (the template, tokenizing, padding...):
    chat_template_kwargs only adds variables for the template, it may not set these."""
    parameters = inspect.signature(tokenizer_class.apply_chat_template).parameters.values()
    named = {p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD}
    return frozenset(named | {"messages"})


def chat_prompt_ids(
    engine: EngineClient,
    messages: list[ChatMessage],
    tools: list[Tool] | None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt's token ids: the rendered template (with the tool definitions, for a template
    that shows them, and the request's chat_template_kwargs) plus the assistant's generation
    prompt, tokenized without adding special tokens again (the template has them)."""
    tokenizer = engine.tokenizer
    template_kwargs = template_kwargs or {}
    reserved = sorted(reserved_template_kwargs(type(tokenizer)) & set(template_kwargs))
    if reserved:
        raise RequestError(
            f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs"
        )
    rendered = [template_message(message) for message in messages]
    definitions = [tool.model_dump(exclude_none=True) for tool in tools or []]
    engine.check_prompt_chars(
        sum(len(message.content) for message in messages) + len(json.dumps(definitions)),
        "messages",
    )
    try:
        prompt = tokenizer.apply_chat_template(
            rendered,
            tools=definitions or None,
            add_generation_prompt=True,
            tokenize=False,
            **template_kwargs,
        )
    except (jinja2.TemplateError, ValueError) as err:
        raise RequestError(f"cannot apply the chat template: {err}", param="messages") from err
    return tokenizer.encode(prompt, add_special_tokens=False)


def answer(
    plan: ToolPlan, out: Output, thinking: tuple[str | None, str] | None = None
) -> tuple[ChatCompletionMessage, str | None]:
    """A whole choice's message (its thinking, content and tool calls) and its finish reason;
    `thinking`: the output split into (reasoning, answer) by `Thinking.split`."""
    reason = finish_reason(out)
    reasoning, text = thinking if thinking is not None else (None, out.text)
    content = text if text or reasoning is None else None
    if not plan.parses or reason != "stop":
        return ChatCompletionMessage(content=content, reasoning_content=reasoning), reason
    content, calls = read_calls(plan, text)
    if not calls:
        return ChatCompletionMessage(content=content, reasoning_content=reasoning), reason
    tool_calls = [
        ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]
    message = ChatCompletionMessage(
        content=content, reasoning_content=reasoning, tool_calls=tool_calls
    )
    return message, calls_finish(plan)


def calls_finish(plan: ToolPlan) -> str:
    """As OpenAI: a call the client forced by name ends with `stop`; one the model chose (or was
    required to make) with `tool_calls`."""
    return "stop" if plan.mode == "named" else "tool_calls"


class ChatChunker:
    """chat.completion.chunk objects: a role chunk per choice, content deltas carrying the logprobs
    of their tokens, tool call deltas, and a finish chunk with an empty delta when a choice
    ends."""

    def __init__(
        self,
        response_id: str,
        model: str,
        n_choices: int,
        logprobs: bool,
        plan: ToolPlan | None = None,
        thinking: Thinking | None = None,
    ) -> None:
        self._chunk = partial(ChatCompletionStreamResponse, id=response_id, model=model)
        self._n_choices = n_choices
        self._logprobs = logprobs
        self._plan = plan if plan is not None and plan.parses else None
        self._tools = [ToolStream(self._plan) for _ in range(n_choices)] if self._plan else []
        self._thinking = thinking.streams() if thinking is not None else None

    def opening(self) -> list[ChatCompletionStreamResponse]:
        role = DeltaMessage(role="assistant", content="")
        return [
            self._chunk(choices=[ChatCompletionStreamChoice(index=index, delta=role)])
            for index in range(self._n_choices)
        ]

    def advance(self, index: int, out: Output) -> list[ChatCompletionStreamResponse]:
        if self._thinking is None:
            return self._advance_answer(index, out)
        # The thinking goes out in deltas of its own; the rest is the answer, as without it.
        stream = self._thinking[index]
        reasoning, text = stream.feed(out.text)
        if out.finish_reason is not None:
            more_reasoning, more_text = stream.finish()
            reasoning, text = reasoning + more_reasoning, text + more_text
        chunks = []
        if reasoning:
            delta = DeltaMessage(reasoning_content=reasoning)
            chunks.append(
                self._chunk(choices=[ChatCompletionStreamChoice(index=index, delta=delta)])
            )
        return chunks + self._advance_answer(index, msgspec.structs.replace(out, text=text))

    def _advance_answer(self, index: int, out: Output) -> list[ChatCompletionStreamResponse]:
        if self._plan is not None:
            return self._advance_tools(index, out)
        logprobs = chat_logprobs(out) if self._logprobs else None
        chunks = []
        if out.text or (logprobs is not None and logprobs.content):
            delta = DeltaMessage(content=out.text)
            choice = ChatCompletionStreamChoice(index=index, delta=delta, logprobs=logprobs)
            chunks.append(self._chunk(choices=[choice]))
        reason = finish_reason(out)
        if reason is not None:
            choice = ChatCompletionStreamChoice(
                index=index, delta=DeltaMessage(), finish_reason=reason
            )
            chunks.append(self._chunk(choices=[choice]))
        return chunks

    def usage(self, usage: UsageInfo) -> ChatCompletionStreamResponse:
        return self._chunk(choices=[], usage=usage)

    def _advance_tools(self, index: int, out: Output) -> list[ChatCompletionStreamResponse]:
        """A choice whose text may hold tool calls: content as it can be sent, then each call's
        id and name, and its arguments as they are written."""
        stream = self._tools[index]
        logprobs = chat_logprobs(out) if self._logprobs else None
        content, pieces = stream.feed(out.text)
        reason = finish_reason(out)
        if reason is not None:
            rest, more = stream.end(clean=reason == "stop")
            content, pieces = content + rest, pieces + more
            if reason == "stop" and stream.calls_begun:
                reason = calls_finish(stream.plan)
        deltas = [DeltaMessage(content=content)] if content else []
        deltas += [call_delta(p.index, p.arguments, p.call_id, p.name) for p in pieces]
        chunks = []
        for position, delta in enumerate(deltas):
            lp = logprobs if position == 0 else None
            choice = ChatCompletionStreamChoice(index=index, delta=delta, logprobs=lp)
            chunks.append(self._chunk(choices=[choice]))
        if not deltas and logprobs is not None and logprobs.content:
            delta = DeltaMessage(content="")
            choice = ChatCompletionStreamChoice(index=index, delta=delta, logprobs=logprobs)
            chunks.append(self._chunk(choices=[choice]))
        if reason is not None:
            finish = ChatCompletionStreamChoice(
                index=index, delta=DeltaMessage(), finish_reason=reason
            )
            chunks.append(self._chunk(choices=[finish]))
        return chunks


def call_delta(
    index: int, arguments: str, call_id: str | None = None, name: str | None = None
) -> DeltaMessage:
    """A delta of tool call `index`: its first part carries the id, type and name."""
    call = ToolCallDelta(
        index=index,
        id=call_id,
        type="function" if call_id is not None else None,
        function=FunctionCallDelta(name=name, arguments=arguments),
    )
    return DeltaMessage(tool_calls=[call])


def chat_logprobs(out: Output) -> ChoiceLogprobs:
    """Chat logprobs of the output's tokens."""
    tops = out.top_logprobs
    content = []
    for pos, chosen in enumerate(out.logprobs or []):
        alternatives = [
            TopLogprob(token=alt.token, logprob=finite(alt.logprob), bytes=list(alt.token_bytes))
            for alt in (tops[pos] if tops else [])
        ]
        content.append(
            ChatCompletionTokenLogprob(
                token=chosen.token,
                logprob=finite(chosen.logprob),
                bytes=list(chosen.token_bytes),
                top_logprobs=alternatives,
            )
        )
    return ChoiceLogprobs(content=content)


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template takes it, as transformers documents: `developer` is
    `system` by its older name; an assistant's tool calls carry their arguments as an object
    (templates render them with `tojson`), and a tool's answer its call id."""
    role = "system" if message.role == "developer" else message.role
    rendered: dict[str, Any] = {"role": role, "content": message.content}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments_object(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        rendered["name"] = message.name
    return rendered


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # not JSON: the template shows it as it came
