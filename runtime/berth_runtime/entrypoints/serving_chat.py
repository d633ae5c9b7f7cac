"""POST /v1/chat/completions: apply the chat template, run the choices, answer JSON or SSE."""

from __future__ import annotations

from functools import partial

import jinja2
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
    TopLogprob,
    UsageInfo,
)
from berth_runtime.entrypoints.serving_base import (
    OpenAIServingBase,
    Output,
    choice_inputs,
    finish_reason,
    finite,
    sampling_params,
    usage_info,
)
from berth_runtime.io_struct import GenerateReqInput


class OpenAIServingChat(OpenAIServingBase[ChatCompletionRequest]):
    """Chat completions: one templated prompt, `n` choices."""

    id_prefix = "chatcmpl"

    def build_inputs(
        self, request: ChatCompletionRequest, raw_request: Request, base_rid: str
    ) -> list[GenerateReqInput]:
        return choice_inputs(
            request,
            raw_request,
            [self._apply_chat_template(request.messages)],
            base_rid,
            sampling_params(request, request.max_new_tokens),
            return_logprob=request.logprobs,
            top_logprobs_num=request.top_logprobs or 0,
        )

    def chunker(
        self, request: ChatCompletionRequest, response_id: str, reqs: list[GenerateReqInput]
    ) -> ChatChunker:
        model = self.tokenizer_manager.model_name
        return ChatChunker(response_id, model, len(reqs), request.logprobs)

    def build_response(
        self,
        request: ChatCompletionRequest,
        response_id: str,
        reqs: list[GenerateReqInput],
        outputs: list[Output],
    ) -> ChatCompletionResponse:
        choices = [
            ChatCompletionChoice(
                index=index,
                message=ChatCompletionMessage(content=out.text),
                logprobs=chat_logprobs(out) if request.logprobs else None,
                finish_reason=finish_reason(out),
            )
            for index, out in enumerate(outputs)
        ]
        return ChatCompletionResponse(
            id=response_id,
            model=self.tokenizer_manager.model_name,
            choices=choices,
            usage=usage_info(outputs, request.n),
        )

    def _apply_chat_template(self, messages: list[ChatMessage]) -> list[int]:
        """The prompt's token ids: the rendered template plus the assistant's generation prompt,
        tokenized without adding special tokens again (the template has them)."""
        tokenizer = self.tokenizer_manager.tokenizer
        self.tokenizer_manager.check_prompt_chars(
            sum(len(message.content) for message in messages), "messages"
        )
        try:
            prompt = tokenizer.apply_chat_template(
                [template_message(message) for message in messages],
                add_generation_prompt=True,
                tokenize=False,
            )
        except (jinja2.TemplateError, ValueError) as err:
            raise RequestError(f"cannot apply the chat template: {err}", param="messages") from err
        return tokenizer.encode(prompt, add_special_tokens=False)


class ChatChunker:
    """chat.completion.chunk objects: a role chunk per choice, content deltas carrying the logprobs
    of their tokens, and a finish chunk with an empty delta when a choice ends."""

    def __init__(self, response_id: str, model: str, n_choices: int, logprobs: bool) -> None:
        self._chunk = partial(ChatCompletionStreamResponse, id=response_id, model=model)
        self._n_choices = n_choices
        self._logprobs = logprobs

    def opening(self) -> list[ChatCompletionStreamResponse]:
        role = DeltaMessage(role="assistant", content="")
        return [
            self._chunk(choices=[ChatCompletionStreamChoice(index=index, delta=role)])
            for index in range(self._n_choices)
        ]

    def advance(self, index: int, out: Output) -> list[ChatCompletionStreamResponse]:
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


def chat_logprobs(out: Output) -> ChoiceLogprobs:
    """Chat logprobs of the output's tokens."""
    tops = out.top_logprobs
    content = []
    for pos, chosen in enumerate(out.logprobs or []):
        alternatives = [
            TopLogprob(token=alt.token, logprob=finite(alt.logprob), bytes=_utf8(alt.token))
            for alt in (tops[pos] if tops else [])
        ]
        content.append(
            ChatCompletionTokenLogprob(
                token=chosen.token,
                logprob=finite(chosen.logprob),
                bytes=_utf8(chosen.token),
                top_logprobs=alternatives,
            )
        )
    return ChoiceLogprobs(content=content)


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def template_message(message: ChatMessage) -> dict[str, str]:
    """A message as the chat template takes it: `developer` is `system` by its older name."""
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": message.content}
