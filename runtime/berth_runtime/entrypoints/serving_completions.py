"""POST /v1/completions: run `n` choices per prompt, echo and legacy logprobs, answer JSON or SSE.

`echo` prepends the prompt (a token-id prompt is decoded) to the choice's text; with `logprobs` it
also returns the prompt's logprobs, the first prompt token's being null. `text_offset` indexes the
choice's returned `text`, so with `echo` the prompt tokens start at 0 and the output tokens at the
length of the echoed prompt. Each `top_logprobs` entry holds the `logprobs` most likely tokens plus
the sampled one (as OpenAI documents), so `logprobs=0` gives just the sampled token.
"""

from __future__ import annotations

from functools import partial

from fastapi import Request

from berth_runtime.entrypoints.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
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
from berth_runtime.io_struct import GenerateReqInput, TokenLogprob

# One position's token with its logprob, and that position's top alternatives.
Position = tuple[TokenLogprob, list[TokenLogprob] | None]


class OpenAIServingCompletion(OpenAIServingBase[CompletionRequest]):
    """Text completions: one or more prompts (text or token ids), `n` choices each."""

    id_prefix = "cmpl"

    def build_inputs(
        self, request: CompletionRequest, raw_request: Request, base_rid: str
    ) -> list[GenerateReqInput]:
        with_logprobs = request.logprobs is not None
        return choice_inputs(
            request,
            raw_request,
            request.prompts(),
            base_rid,
            sampling_params(request, request.max_tokens),
            return_logprob=with_logprobs,
            top_logprobs_num=request.logprobs or 0,
            logprob_start_len=0 if request.echo and with_logprobs else -1,
        )

    def chunker(
        self, request: CompletionRequest, response_id: str, reqs: list[GenerateReqInput]
    ) -> CompletionChunker:
        echoes = [self._echo(request, req) for req in reqs]
        model = request.model or self.tokenizer_manager.model_name
        return CompletionChunker(response_id, model, echoes, request.logprobs is not None)

    def build_response(
        self,
        request: CompletionRequest,
        response_id: str,
        reqs: list[GenerateReqInput],
        outputs: list[Output],
    ) -> CompletionResponse:
        choices = []
        for index, (req, out) in enumerate(zip(reqs, outputs, strict=True)):
            echo = self._echo(request, req)
            logprobs = None
            if request.logprobs is not None:
                prompt = prompt_positions(out)
                logprobs = completion_logprobs(prompt, output_positions(out), len(echo))
            choices.append(
                CompletionChoice(
                    index=index,
                    text=echo + out.text,
                    logprobs=logprobs,
                    finish_reason=finish_reason(out),
                )
            )
        return CompletionResponse(
            id=response_id,
            model=request.model or self.tokenizer_manager.model_name,
            choices=choices,
            usage=usage_info(outputs, request.n),
        )

    def _echo(self, request: CompletionRequest, req: GenerateReqInput) -> str:
        if not request.echo:
            return ""
        if req.text is not None:
            return req.text
        return self.tokenizer_manager.tokenizer.decode(req.input_ids)


class CompletionChunker:
    """text_completion chunks: text deltas (the echoed prompt before a choice's first one) carrying
    the logprobs of their tokens, and a finish chunk with empty text when a choice ends."""

    def __init__(self, response_id: str, model: str, echoes: list[str], logprobs: bool) -> None:
        self._chunk = partial(CompletionStreamResponse, id=response_id, model=model)
        self._echoes = echoes  # emptied once sent
        self._logprobs = logprobs
        self._offsets = [len(echo) for echo in echoes]  # text offset of the next output token

    def opening(self) -> list[CompletionStreamResponse]:
        return []

    def advance(self, index: int, out: Output) -> list[CompletionStreamResponse]:
        echo, self._echoes[index] = self._echoes[index], ""
        text = echo + out.text
        logprobs = None
        if self._logprobs:
            prompt = prompt_positions(out) if echo else []
            output = output_positions(out)
            logprobs = completion_logprobs(prompt, output, self._offsets[index])
            self._offsets[index] += sum(len(chosen.token) for chosen, _ in output)
        chunks = []
        if text or (logprobs is not None and logprobs.tokens):
            choice = CompletionChoice(index=index, text=text, logprobs=logprobs)
            chunks.append(self._chunk(choices=[choice]))
        reason = finish_reason(out)
        if reason is not None:
            choice = CompletionChoice(index=index, text="", finish_reason=reason)
            chunks.append(self._chunk(choices=[choice]))
        return chunks

    def usage(self, usage: UsageInfo) -> CompletionStreamResponse:
        return self._chunk(choices=[], usage=usage)


def output_positions(out: Output) -> list[Position]:
    """The output's tokens with their logprobs and top alternatives."""
    tokens = out.logprobs or []
    return list(zip(tokens, out.top_logprobs or [None] * len(tokens), strict=True))


def prompt_positions(out: Output) -> list[Position]:
    """The prompt's tokens with their logprobs (None for the first) and top alternatives."""
    tokens = out.prompt_logprobs or []
    return list(zip(tokens, out.prompt_top_logprobs or [None] * len(tokens), strict=True))


def completion_logprobs(
    prompt: list[Position], output: list[Position], output_offset: int
) -> CompletionLogprobs:
    """Legacy logprobs of the prompt positions (offsets from 0), then of the output positions."""
    logprobs = CompletionLogprobs()
    for part, offset in ((prompt, 0), (output, output_offset)):
        for chosen, top in part:
            logprobs.tokens.append(chosen.token)
            logprobs.text_offset.append(offset)
            offset += len(chosen.token)
            if chosen.logprob is None:  # the first prompt token has no logprob
                logprobs.token_logprobs.append(None)
                logprobs.top_logprobs.append(None)
                continue
            best = {alt.token: finite(alt.logprob) for alt in top or []}
            best.setdefault(chosen.token, finite(chosen.logprob))
            logprobs.token_logprobs.append(finite(chosen.logprob))
            logprobs.top_logprobs.append(best)
    return logprobs
