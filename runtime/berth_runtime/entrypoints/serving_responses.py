"""POST /v1/responses (and GET / DELETE of stored ones): the Responses API on the chat engine path.

A request becomes chat messages (its instructions as a system message, then the stored
conversation of `previous_response_id`, then its input), one templated prompt and one engine
request. `ResponseBuilder` turns the engine's outputs into output items, a message with
`output_text` and `function_call` items, and into the stream events that build them, in OpenAI's
order: `response.created`, `response.in_progress`, then per item `output_item.added`, its deltas,
`output_item.done`, and last `response.completed` (`response.incomplete` when max_output_tokens
cut it, `response.failed` when the engine could not finish it). A response that does not stream
is built by the same builder from one whole output, so both answers are the same.

Over 400 lines because the events and the output items they build are one state machine (the
builder); the handler around it is short.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from starlette.responses import Response, StreamingResponse

from berth_common.errors import RequestError
from berth_common.http import sse_event
from berth_common.response_ids import new_response_id
from berth_runtime.entrypoints.protocol import (
    ChatMessage,
    FunctionCall,
    ToolCall,
)
from berth_runtime.entrypoints.protocol_responses import (
    DeletedResponse,
    IncompleteDetails,
    InputTokensDetails,
    LogprobAlternative,
    OutputFunctionCall,
    OutputItem,
    OutputLogprob,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from berth_runtime.entrypoints.reasoning import ReasoningStream
from berth_runtime.entrypoints.response_store import ResponseStore, StoredResponse
from berth_runtime.entrypoints.serving_base import (
    SSE_HEADERS,
    ChoiceStreams,
    EngineClient,
    Output,
    check_grammar,
    check_model,
    choice_inputs,
    finite,
    raise_if_aborted,
    sampling_params,
    usage_info,
)
from berth_runtime.entrypoints.serving_chat import Thinking, chat_prompt_ids, tool_call_parser
from berth_runtime.entrypoints.tool_calls import ToolPlan
from berth_runtime.entrypoints.tool_stream import CallPiece, ToolStream, new_call_id
from berth_runtime.io_struct import GenerateReqInput, TokenLogprob

Event = dict[str, Any]


class OpenAIServingResponses:
    """The Responses API: create (JSON or event stream), retrieve and delete."""

    def __init__(self, engine: EngineClient, store: ResponseStore, dp_rank: int | None) -> None:
        self.engine = engine
        self.store = store
        self.dp_rank = dp_rank

    async def create(self, request: ResponsesRequest, raw_request: Request) -> Response:
        engine = self.engine
        adapter = check_model(engine, request.model)
        history: list[ChatMessage] = []
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id, "previous_response_id")
            history = previous.conversation
        conversation = [*history, *request.input_messages()]
        check_grammar(engine, request)
        response = self._new_response(request)
        reqs = await engine.run_tokenizer(
            self._inputs, request, raw_request, conversation, request.rid or response.id
        )
        for req in reqs:
            req.lora_name = adapter
        plan = request.tool_plan(tool_call_parser(engine))
        thinking = Thinking.of(engine, reqs).streams()
        builder = ResponseBuilder(
            response, plan, request.logprobs, thinking[0] if thinking else None
        )
        streams = ChoiceStreams(engine, reqs, raw_request, request.stream)
        outputs = await streams.start()
        if request.stream:
            events = self._events(streams, builder, request, conversation)
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        await streams.close()
        builder.advance(outputs[0])
        self._keep(request, builder.response, conversation)
        return Response(
            builder.response.model_dump_json(by_alias=True), media_type="application/json"
        )

    def retrieve(self, response_id: str) -> Response:
        response = self.store.get(response_id).response
        return Response(response.model_dump_json(by_alias=True), media_type="application/json")

    def delete(self, response_id: str) -> Response:
        self.store.delete(response_id)
        return Response(DeletedResponse(id=response_id).model_dump_json())

    def _new_response(self, request: ResponsesRequest) -> ResponseObject:
        return ResponseObject(
            id=new_response_id(self.dp_rank),
            model=request.model or self.engine.model_name,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_logprobs=request.top_logprobs,
            tools=request.tools,
            tool_choice=request.tool_choice or ("auto" if request.tools else "none"),
            parallel_tool_calls=request.parallel_tool_calls,
            previous_response_id=request.previous_response_id,
            store=request.store,
            text=request.text,
            metadata=request.metadata or {},
            user=request.user,
        )

    def _inputs(
        self,
        request: ResponsesRequest,
        raw_request: Request,
        conversation: list[ChatMessage],
        rid: str,
    ) -> list[GenerateReqInput]:
        """The one engine request: instructions first (never carried over from a previous
        response, as OpenAI does), then the conversation."""
        messages = list(conversation)
        if request.instructions is not None:
            messages.insert(0, ChatMessage(role="system", content=request.instructions))
        prompt = chat_prompt_ids(self.engine, messages, request.chat_tools())
        return choice_inputs(
            request,
            raw_request,
            [prompt],
            rid,
            sampling_params(request, request.max_output_tokens),
            return_logprob=request.logprobs,
            top_logprobs_num=request.top_logprobs,
        )

    async def _events(
        self,
        streams: ChoiceStreams,
        builder: ResponseBuilder,
        request: ResponsesRequest,
        conversation: list[ChatMessage],
    ) -> AsyncIterator[str]:
        """The event stream; closing it early (the client went away) aborts the request."""
        try:
            for event in builder.opening():
                yield sse_event(event, event=event["type"])
            async for _, out in streams.outputs():
                raise_if_aborted(out)
                for event in builder.advance(out):
                    yield sse_event(event, event=event["type"])
            self._keep(request, builder.response, conversation)
        except RequestError as err:
            for event in builder.failed(err):
                yield sse_event(event, event=event["type"])
        finally:
            await streams.close()

    def _keep(
        self,
        request: ResponsesRequest,
        response: ResponseObject,
        conversation: list[ChatMessage],
    ) -> None:
        if request.store:
            answer = assistant_message(response.output)
            self.store.put(StoredResponse(response, [*conversation, answer]))


def assistant_message(output: list[OutputItem]) -> ChatMessage:
    """A response's output as the assistant's message of the conversation."""
    text = "".join(
        part.text for item in output if isinstance(item, OutputMessage) for part in item.content
    )
    calls = [
        ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
        for item in output
        if isinstance(item, OutputFunctionCall)
    ]
    return ChatMessage(role="assistant", content=text, tool_calls=calls or None)


class ResponseBuilder:
    """One response's output items, built from its engine outputs, with the events that say so.

    With --reasoning-parser, a reasoning model's thinking comes first, in a `reasoning` item
    (`response.reasoning_text.delta` events), closed when the answer begins. Text goes into one
    assistant message, opened at its first text. Tool calls are read from the text as chat reads
    them (`ToolStream`): each call is added once its name is written (closing the message before
    it), and its arguments stream as they are generated.
    """

    def __init__(
        self,
        response: ResponseObject,
        plan: ToolPlan,
        logprobs: bool,
        thinking: ReasoningStream | None = None,
    ) -> None:
        self.response = response
        self._tools = ToolStream(plan) if plan.parses else None
        self._thinking = thinking
        self._reasoning: OutputReasoning | None = None
        self._logprobs = logprobs
        self._pending_logprobs: list[OutputLogprob] = []  # of text not sent yet
        self._message: OutputMessage | None = None
        self._calls: list[OutputFunctionCall] = []
        self._sequence = 0

    def opening(self) -> list[Event]:
        return [
            self._event("response.created", response=self._snapshot()),
            self._event("response.in_progress", response=self._snapshot()),
        ]

    def advance(self, out: Output) -> list[Event]:
        """The events of one output; the closing ones too when it is the last."""
        if self._logprobs:
            self._pending_logprobs += output_logprobs(out)
        events: list[Event] = []
        text = out.text
        if self._thinking is not None:
            thought, text = self._thinking.feed(text)
            if out.finish_reason is not None:
                more_thought, more_text = self._thinking.finish()
                thought, text = thought + more_thought, text + more_text
            events += self._thought(thought)
            if text:
                events += self._close_reasoning("completed")
        if self._tools is None:
            events += self._text(text)
        else:
            content, pieces = self._tools.feed(text)
            events += self._text(content) + self._call_pieces(pieces)
        if out.finish_reason is not None:
            events += self._finish(out)
        return events

    def failed(self, err: RequestError) -> list[Event]:
        self.response.status = "failed"
        self.response.error = ResponseError(code=err.code or "server_error", message=err.message)
        return [self._event("response.failed", response=self._snapshot())]

    # --- items ------------------------------------------------------------------------------------

    def _thought(self, delta: str) -> list[Event]:
        if not delta:
            return []
        events = []
        if self._reasoning is None:
            self._reasoning = OutputReasoning(id=f"rs_{new_call_id()[5:]}")
            self._reasoning.content.append(ReasoningText())
            events.append(self._add(self._reasoning))
        self._reasoning.content[0].text += delta
        events.append(
            self._event(
                "response.reasoning_text.delta",
                **self._where(self._reasoning),
                content_index=0,
                delta=delta,
            )
        )
        return events

    def _close_reasoning(self, status: str) -> list[Event]:
        item = self._reasoning
        if item is None or item.status != "in_progress":
            return []
        item.status = status  # type: ignore[assignment]
        where = self._where(item)
        return [
            self._event(
                "response.reasoning_text.done",
                **where,
                content_index=0,
                text=item.content[0].text,
            ),
            self._event(
                "response.output_item.done",
                output_index=where["output_index"],
                item=item.model_dump(mode="json"),
            ),
        ]

    def _text(self, text: str) -> list[Event]:
        if not text:
            return []
        events = [] if self._message is not None else self._open_message()
        assert self._message is not None
        part = self._message.content[0]
        part.text += text
        logprobs, self._pending_logprobs = self._pending_logprobs, []
        part.logprobs += logprobs
        events.append(
            self._event(
                "response.output_text.delta",
                **self._where(self._message),
                content_index=0,
                delta=text,
                logprobs=[lp.model_dump(mode="json") for lp in logprobs],
            )
        )
        return events

    def _open_message(self) -> list[Event]:
        self._message = OutputMessage(id=f"msg_{new_call_id()[5:]}")
        item = self._add(self._message)
        part = OutputText()
        self._message.content.append(part)
        return [
            item,
            self._event(
                "response.content_part.added",
                **self._where(self._message),
                content_index=0,
                part=part.model_dump(mode="json"),
            ),
        ]

    def _call_pieces(self, pieces: list[CallPiece]) -> list[Event]:
        events = []
        for piece in pieces:
            if piece.call_id is not None:
                if self._message is not None and self._message.status == "in_progress":
                    events += self._close_message("completed")
                assert piece.name is not None
                item = OutputFunctionCall(
                    id=f"fc_{piece.call_id[5:]}", call_id=piece.call_id, name=piece.name
                )
                self._calls.append(item)
                events.append(self._add(item))
            item = self._calls[piece.index]
            if piece.arguments:
                item.arguments += piece.arguments
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        **self._where(item),
                        delta=piece.arguments,
                    )
                )
        return events

    def _finish(self, out: Output) -> list[Event]:
        cut = out.finish_reason is not None and out.finish_reason.type == "length"
        events: list[Event] = []
        if self._tools is not None:
            rest, pieces = self._tools.end(clean=not cut)
            events += self._text(rest) + self._call_pieces(pieces)
        if self._message is None and not self._calls:
            events += self._open_message()  # an empty answer is still a message
        status = "incomplete" if cut else "completed"
        events += self._close_reasoning(status)
        if self._message is not None and self._message.status == "in_progress":
            events += self._close_message(status)
        for item in self._calls:
            events += self._close_call(item, status)
        usage = usage_info([out], 1)
        self.response.usage = ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=usage.prompt_tokens_details.cached_tokens
                if usage.prompt_tokens_details
                else 0
            ),
            output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
        )
        self.response.status = status
        if cut:
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        final = "response.incomplete" if cut else "response.completed"
        events.append(self._event(final, response=self._snapshot()))
        return events

    def _close_message(self, status: str) -> list[Event]:
        message = self._message
        assert message is not None
        part = message.content[0]
        message.status = status  # type: ignore[assignment]
        where = self._where(message)
        return [
            self._event(
                "response.output_text.done",
                **where,
                content_index=0,
                text=part.text,
                logprobs=[lp.model_dump(mode="json") for lp in part.logprobs],
            ),
            self._event(
                "response.content_part.done",
                **where,
                content_index=0,
                part=part.model_dump(mode="json"),
            ),
            self._event(
                "response.output_item.done",
                output_index=where["output_index"],
                item=message.model_dump(mode="json"),
            ),
        ]

    def _close_call(self, item: OutputFunctionCall, status: str) -> list[Event]:
        item.status = status  # type: ignore[assignment]
        where = self._where(item)
        return [
            self._event(
                "response.function_call_arguments.done",
                **where,
                name=item.name,
                arguments=item.arguments,
            ),
            self._event(
                "response.output_item.done",
                output_index=where["output_index"],
                item=item.model_dump(mode="json"),
            ),
        ]

    # --- plumbing ---------------------------------------------------------------------------------

    def _add(self, item: OutputItem) -> Event:
        self.response.output.append(item)
        return self._event(
            "response.output_item.added",
            output_index=len(self.response.output) - 1,
            item=item.model_dump(mode="json"),
        )

    def _where(self, item: OutputItem) -> dict[str, Any]:
        index = next(i for i, it in enumerate(self.response.output) if it is item)
        return {"item_id": item.id, "output_index": index}

    def _snapshot(self) -> dict[str, Any]:
        return self.response.model_dump(mode="json", by_alias=True)

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event


def output_logprobs(out: Output) -> list[OutputLogprob]:
    """The logprobs of an output's tokens, with their alternatives, as output_text carries them."""
    tops = out.top_logprobs
    return [
        OutputLogprob(
            **_alternative(chosen).model_dump(),
            top_logprobs=[_alternative(alt) for alt in (tops[pos] if tops else [])],
        )
        for pos, chosen in enumerate(out.logprobs or [])
    ]


def _alternative(entry: TokenLogprob) -> LogprobAlternative:
    return LogprobAlternative(
        token=entry.token, logprob=finite(entry.logprob or 0.0), bytes=list(entry.token_bytes)
    )
