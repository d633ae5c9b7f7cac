"""POST /generate: SGLang's native API: text or token ids in (one or a batch), text, ids and
meta_info out, as JSON or as SSE events that each carry everything so far."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from starlette.responses import JSONResponse, Response, StreamingResponse

from berth_common.errors import RequestError
from berth_common.http import SSE_DONE, sse_event
from berth_runtime.entrypoints.protocol import StrictBool, document_as_parsed, json_integers
from berth_runtime.entrypoints.serving_base import (
    SSE_HEADERS,
    ChoiceStreams,
    EngineClient,
    check_sequences,
    raise_if_aborted,
)
from berth_runtime.io_struct import GenerateReqInput, RequestOutput, TokenLogprob
from berth_runtime.sampling_params import SamplingParams


def _sampling_params_schema() -> dict[str, Any]:
    schema = msgspec.json.schema(SamplingParams)["$defs"]["SamplingParams"]
    schema["additionalProperties"] = False  # an unknown sampling parameter is a 400
    return {"anyOf": [schema, {"type": "null"}]}


def _exactly_one_prompt(schema: dict[str, Any]) -> None:
    document_as_parsed(schema)
    for name in ("text", "input_ids"):  # present means given: null is no prompt
        prop = schema["properties"][name]
        prop["anyOf"] = [p for p in prop["anyOf"] if p.get("type") != "null"]
    schema["oneOf"] = [{"required": ["text"]}, {"required": ["input_ids"]}]


class GenerateRequest(BaseModel):
    """The body of `/generate`, for its OpenAPI document (`parse_generate` reads it field by
    field, to name the field at fault). Exactly one of `text` and `input_ids`; a list of them is
    a batch."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_exactly_one_prompt)

    text: (  # type: ignore[assignment]
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    ) = None
    input_ids: (  # type: ignore[assignment]
        Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]],
            Field(min_length=1),
        ]
    ) = None
    sampling_params: Annotated[dict[str, Any] | None, WithJsonSchema(_sampling_params_schema())] = (
        None
    )
    stream: StrictBool | None = False
    rid: str | None = Field(None, min_length=1)
    return_logprob: StrictBool | None = False
    top_logprobs_num: int | None = 0
    logprob_start_len: int | None = -1
    routed_dp_rank: int | None = Field(None, ge=0)
    priority: int | None = None
    routing_key: str | None = None  # the router's; checked, not used here
    lora_path: str | None = Field(None, min_length=1)  # the LoRA adapter's name (as SGLang's)


GENERATE_FIELDS = set(GenerateRequest.model_fields)


class NativeServingGenerate:
    """`/generate`: one GenerateReqInput per prompt; a batch answers a list, in prompt order."""

    def __init__(self, tokenizer_manager: EngineClient) -> None:
        self.tokenizer_manager = tokenizer_manager

    async def handle_request(self, body: dict[str, Any], raw_request: Request) -> Response:
        objs, is_batch = parse_generate(body)
        check_sequences(
            len(objs), self.tokenizer_manager, "text" if "text" in body else "input_ids"
        )
        if is_batch and any(o.stream for o in objs):
            raise RequestError("streaming is only supported for a single prompt", param="stream")
        stream = not is_batch and objs[0].stream
        streams = ChoiceStreams(self.tokenizer_manager, objs, raw_request, stream)
        outputs = await streams.start()  # errors before the first token stay plain HTTP errors
        if stream:
            return StreamingResponse(
                _events(streams, objs[0]), media_type="text/event-stream", headers=SSE_HEADERS
            )
        await streams.close()
        results = [generate_result(obj, out) for obj, out in zip(objs, outputs)]
        return JSONResponse(results if is_batch else results[0])


async def _events(streams: ChoiceStreams, obj: GenerateReqInput) -> AsyncIterator[str]:
    """Each SSE event carries the whole output so far, as SGLang's /generate stream does."""
    so_far: RequestOutput | None = None
    try:
        async for _, out in streams.outputs():
            so_far = out if so_far is None else so_far.followed_by(out)
            raise_if_aborted(out)
            yield sse_event(generate_result(obj, so_far))
    except RequestError as e:
        yield sse_event(e.body())
    finally:
        await streams.close()
    yield SSE_DONE


def generate_result(obj: GenerateReqInput, out: RequestOutput) -> dict[str, Any]:
    """`{text, output_ids, meta_info}` of a request's whole output so far."""
    meta: dict[str, Any] = {
        "id": out.rid,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "finish_reason": out.finish_reason.to_json() if out.finish_reason else None,
    }
    if obj.return_logprob:
        meta["output_token_logprobs"] = _triples(out.logprobs or [])
        if obj.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [_triples(top) for top in out.top_logprobs or []]
        if obj.logprob_start_len == 0 and out.prompt_logprobs is not None:
            meta["input_token_logprobs"] = _triples(out.prompt_logprobs)
            if obj.top_logprobs_num > 0:
                meta["input_top_logprobs"] = [
                    None if top is None else _triples(top) for top in out.prompt_top_logprobs or []
                ]
    if out.timing is not None:
        meta["timing"] = msgspec.structs.asdict(out.timing)
    return {"text": out.text, "output_ids": out.token_ids, "meta_info": meta}


def _triples(entries: list[TokenLogprob]) -> list[tuple[float | None, int, str]]:
    """SGLang's (logprob, token id, token text) form."""
    return [(e.logprob, e.token_id, e.token) for e in entries]


def parse_generate(body: dict[str, Any]) -> tuple[list[GenerateReqInput], bool]:
    """A `/generate` body -> one GenerateReqInput per prompt, and whether it was a batch."""
    try:
        body = json_integers(body)  # `2.0` is an integer to JSON Schema, and so here
    except ValueError as e:
        raise RequestError(str(e)) from None
    unknown = set(body) - GENERATE_FIELDS
    if unknown:
        raise RequestError(f"unknown field(s): {', '.join(sorted(unknown))}", param=min(unknown))
    raw_params = body.get("sampling_params")
    raw_params = {} if raw_params is None else raw_params
    if not isinstance(raw_params, dict):
        raise RequestError("sampling_params must be an object", param="sampling_params")
    unknown_params = set(raw_params) - set(SamplingParams.__struct_fields__)
    if unknown_params:
        raise RequestError(
            f"unknown sampling parameter(s): {', '.join(sorted(unknown_params))}",
            param="sampling_params",
        )
    try:
        params = msgspec.convert(raw_params, SamplingParams)
    except msgspec.ValidationError as e:
        raise RequestError(f"sampling_params: {e}", param="sampling_params") from e

    text, input_ids = body.get("text"), body.get("input_ids")
    if ("text" in body) == ("input_ids" in body):
        raise RequestError("exactly one of text or input_ids is required", param="text")
    prompts: list[tuple[str | None, list[int] | None]]
    if isinstance(text, str):
        prompts, is_batch = [(text, None)], False
    elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        prompts, is_batch = [(t, None) for t in text], True
    elif _is_ids(input_ids):
        prompts, is_batch = [(None, input_ids)], False
    elif isinstance(input_ids, list) and input_ids and all(_is_ids(ids) for ids in input_ids):
        prompts, is_batch = [(None, ids) for ids in input_ids], True
    else:
        param = "text" if text is not None else "input_ids"
        raise RequestError(
            f"{param} must be a string / token-id list or a non-empty list of them", param=param
        )

    base_rid = body.get("rid")
    if base_rid is not None and (not isinstance(base_rid, str) or not base_rid):
        raise RequestError("rid must be a non-empty string", param="rid")
    common = {}
    try:
        for key, typ in (
            ("stream", bool),
            ("return_logprob", bool),
            ("top_logprobs_num", int),
            ("logprob_start_len", int),
            ("routed_dp_rank", int),
            ("priority", int),
            ("routing_key", str),  # the router's; checked, not used here
            ("lora_path", str),
        ):
            if body.get(key) is not None:
                value = msgspec.convert(body[key], typ)
                if key == "lora_path":
                    common["lora_name"] = value
                elif key != "routing_key":
                    common[key] = value
    except msgspec.ValidationError as e:
        raise RequestError(f"{key}: {e}", param=key) from e
    objs = []
    for i, (t, ids) in enumerate(prompts):
        rid = None if base_rid is None else (f"{base_rid}-{i}" if is_batch else str(base_rid))
        objs.append(
            GenerateReqInput(text=t, input_ids=ids, sampling_params=params, rid=rid, **common)
        )
    return objs, is_batch


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )
