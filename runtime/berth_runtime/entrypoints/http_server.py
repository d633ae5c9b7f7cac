"""The FastAPI app: OpenAI and native routes, health, auth, and errors as OpenAI-style bodies."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from berth_common.auth import ApiKeyMiddleware, require_admin
from berth_common.body_guard import BodyGuardMiddleware
from berth_common.errors import RequestError
from berth_common.http import RequestIdMiddleware, add_error_handlers, error_response
from berth_common.openapi import (
    METRICS_ANSWER,
    OBJECT,
    SSE,
    answers,
    honest_openapi,
    plain_answers,
)
from berth_runtime import __version__
from berth_runtime.entrypoints.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    StrictBool,
    document_as_parsed,
    validation_error,
)
from berth_runtime.entrypoints.protocol_responses import (
    DeletedResponse,
    ResponseObject,
    ResponsesRequest,
)
from berth_runtime.entrypoints.serving_generate import GenerateRequest
from berth_runtime.io_struct import GenerateReqInput, LoraAdapterOut
from berth_runtime.metrics import HttpMetricsMiddleware, MetricsCollector
from berth_runtime.sampling_params import SamplingParams
from berth_runtime.server_args import ServerArgs, max_request_body_bytes

# Endpoints that stay open without an API key (probes, scrapers and the operator, which reads
# the load without holding the key; they say no more than /metrics does).
OPEN_PATHS = frozenset({"/health", "/metrics", "/get_load", "/v1/loads"})
# Routes that act on the whole server, for the admin key alone (`/abort_request` with
# `abort_all` too, checked in the route: its admin-ness is in the body).
LORA_ADMIN_PATHS = (
    "/load_lora_adapter",
    "/unload_lora_adapter",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
)
ADMIN_PATHS = frozenset({"/flush_cache", *LORA_ADMIN_PATHS})
SECRET_ARGS = frozenset({"api_key", "admin_api_key"})
HEALTH_GENERATE_TIMEOUT_S = 20.0


class HealthStatus(BaseModel):
    status: str
    reason: str | None = None


def _one_or_all(schema: dict[str, Any]) -> None:
    document_as_parsed(schema)
    schema["anyOf"] = [
        {"required": ["rid"], "properties": {"rid": {"type": "string"}}},
        {"required": ["abort_all"], "properties": {"abort_all": {"const": True}}},
    ]


class AbortRequest(BaseModel):
    """The body of `/abort_request` (read field by field by the route, for its OpenAPI document)."""

    model_config = ConfigDict(json_schema_extra=_one_or_all)

    rid: str | None = Field(None, min_length=1)
    abort_all: StrictBool = False


# What the OpenAPI document says each route answers (berth_common.openapi).
GENERATION_ERRORS = (400, 401, 404, 413, 500, 503)
GENERATE_ANSWER = {"anyOf": [{"type": "object"}, {"type": "array", "items": {"type": "object"}}]}
HEALTH_ANSWERS: dict[int | str, Any] = {
    200: {"model": HealthStatus},
    503: {"model": HealthStatus, "description": "Loading, draining, or the engine is stuck"},
}
ABORT_ANSWERS = plain_answers(
    answers(400, 401, 403, 413, 503, ok=OBJECT), {404: "No such request is running"}
)
# The scheduler's heartbeat (every 0.5 s, through the detokenizer) older than this: a wedged loop.
HEARTBEAT_STALE_S = 5.0


@dataclass
class ServerState:
    """What the API process knows about its engine; shared by routes and the launcher."""

    args: ServerArgs
    phase: str = "loading"  # loading -> ready -> draining | dead
    reason: str = ""
    model_path: str = ""
    engine_info: dict[str, Any] = field(default_factory=dict)
    started_time: float = field(default_factory=time.time)
    ready_time: float = 0.0
    load_progress: dict[str, Any] = field(default_factory=dict)  # from the scheduler while loading
    metrics: MetricsCollector = field(init=False)
    tokenizer_manager: Any = None  # TokenizerManager once the engine is up
    serving_chat: Any = None
    serving_completion: Any = None
    serving_generate: Any = None
    serving_responses: Any = None

    def __post_init__(self) -> None:
        self.metrics = MetricsCollector(self.args.model_name, self.args.dp_rank)

    def max_request_body_bytes(self) -> int:
        """The body limit: sized by the context length once the engine has told it."""
        tm = self.tokenizer_manager
        context_len = tm.context_len if tm is not None else self.args.context_length or 0
        return max_request_body_bytes(self.args, context_len)

    def require_ready(self) -> Any:
        if self.phase == "loading":
            raise RequestError("the model is still loading", HTTPStatus.SERVICE_UNAVAILABLE)
        if self.tokenizer_manager is None:
            raise RequestError(f"the server is {self.phase}", HTTPStatus.SERVICE_UNAVAILABLE)
        return self.tokenizer_manager


class RankHeaderMiddleware:
    """Tell every client which data-parallel rank answered (`X-Data-Parallel-Rank`)."""

    def __init__(self, app: Any, dp_rank: int) -> None:
        self.app = app
        self.header = (b"x-data-parallel-rank", str(dp_rank).encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_rank(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_with_rank)


def add_api_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI body; invalid request fields are 400s (never FastAPI's 422)."""
    add_error_handlers(app, "internal error")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()))


def create_app(state: ServerState, lifespan: Any = None) -> Any:
    """The ASGI app (FastAPI wrapped in the auth and rank-header middlewares when configured)."""
    app = FastAPI(title="Berth", version=__version__, lifespan=lifespan)
    app.state.server = state

    add_api_error_handlers(app)

    # --- health ---------------------------------------------------------------------------

    @app.get("/health", responses=HEALTH_ANSWERS)
    async def health() -> Response:
        ok, reason = _health(state)
        if ok:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": state.phase, "reason": reason}, status_code=503)

    @app.get("/health_generate", responses=HEALTH_ANSWERS)
    async def health_generate(request: Request) -> Response:
        ok, reason = _health(state)
        if not ok:
            return JSONResponse({"status": state.phase, "reason": reason}, status_code=503)
        tm = state.tokenizer_manager
        obj = GenerateReqInput(
            input_ids=[0],
            sampling_params=SamplingParams(max_new_tokens=1, ignore_eos=True),
            rid=f"health-{uuid.uuid4().hex}",
            log_metrics=False,
        )
        try:
            async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
                async for _ in tm.generate_request(obj):
                    pass
        except (TimeoutError, RequestError) as e:
            return JSONResponse({"status": "unhealthy", "reason": str(e) or "timeout"}, 503)
        return JSONResponse({"status": "ok"})

    # --- info -----------------------------------------------------------------------------

    @app.get("/v1/models", responses=answers(401, ok=ModelList))
    async def list_models() -> Response:
        return JSONResponse({"object": "list", "data": _model_cards(state)})

    @app.get("/v1/models/{model:path}", responses=answers(401, 404, ok=ModelCard))
    async def get_model(model: str) -> Response:
        for card in _model_cards(state):
            if card["id"] == model:
                return JSONResponse(card)
        raise RequestError(
            f"The model `{model}` does not exist.", 404, param="model", code="model_not_found"
        )

    @app.get("/get_model_info", responses=answers(401, ok=OBJECT))
    async def get_model_info() -> Response:
        return JSONResponse(
            {
                "model_path": state.model_path or state.args.model,
                "served_model_name": state.args.model_name,
                "tokenizer_path": state.model_path,
                "is_generation": True,
                "context_length": state.engine_info.get("context_len"),
                "vocab_size": state.engine_info.get("vocab_size"),
            }
        )

    @app.get("/get_server_info", responses=answers(401, ok=OBJECT))
    async def get_server_info() -> Response:
        server_args = {k: v for k, v in vars(state.args).items() if k not in SECRET_ARGS}
        return JSONResponse(
            {
                "version": __version__,
                "phase": state.phase,
                "reason": state.reason,
                "dp_rank": state.args.dp_rank,
                "model_path": state.model_path,
                "served_model_name": state.args.model_name,
                "server_args": server_args,
                "engine": state.engine_info,
                "load_progress": state.load_progress,
                "max_request_body_bytes": state.max_request_body_bytes(),
                "started_time": state.started_time,
                "load_time_s": (state.ready_time - state.started_time)
                if state.ready_time
                else None,
            }
        )

    @app.get("/metrics", response_class=PlainTextResponse, responses=METRICS_ANSWER)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/get_load", responses=answers(ok=OBJECT))
    @app.get("/v1/loads", responses=answers(ok=OBJECT))
    async def get_load() -> Response:
        tm = state.tokenizer_manager
        stats = tm.last_stats if tm is not None else None
        load: dict[str, Any] = {
            "dp_rank": state.args.dp_rank,
            "phase": state.phase,
            "num_inflight_requests": len(tm.rid_to_state) if tm is not None else 0,
        }
        max_tokens = state.engine_info.get("max_total_num_tokens", 0)
        load.update(  # before the first heartbeat: an idle engine
            num_running_reqs=stats.num_running_reqs if stats else 0,
            num_waiting_reqs=stats.num_waiting_reqs if stats else 0,
            num_used_tokens=stats.num_used_tokens if stats else 0,
            num_cached_tokens=stats.num_cached_tokens if stats else 0,
            max_total_num_tokens=stats.max_total_num_tokens if stats else max_tokens,
            token_usage=stats.num_used_tokens / max(stats.max_total_num_tokens, 1)
            if stats
            else 0.0,
            gen_throughput=stats.gen_throughput if stats else 0.0,
            timestamp=stats.time if stats else None,
        )
        if tm is not None and tm.lora.enabled:
            # What a router needs for adapter affinity: the adapters this rank serves, and those
            # in its device slots (a request for one of them runs at once).
            load["lora_adapters"] = sorted(tm.lora.adapters)
            load["lora_resident"] = stats.lora_running if stats else []
        return JSONResponse(load)

    # --- generation -----------------------------------------------------------------------

    @app.post(
        "/v1/chat/completions",
        responses=answers(*GENERATION_ERRORS, ok=ChatCompletionResponse, ok_media=SSE),
    )
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        state.require_ready()
        return await state.serving_chat.handle_request(request, raw_request)

    @app.post(
        "/v1/completions",
        responses=answers(*GENERATION_ERRORS, ok=CompletionResponse, ok_media=SSE),
    )
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        state.require_ready()
        return await state.serving_completion.handle_request(request, raw_request)

    @app.post(
        "/v1/responses", responses=answers(*GENERATION_ERRORS, ok=ResponseObject, ok_media=SSE)
    )
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        state.require_ready()
        return await state.serving_responses.create(request, raw_request)

    @app.get("/v1/responses/{response_id}", responses=answers(401, 404, 503, ok=ResponseObject))
    async def retrieve_response(response_id: str) -> Response:
        state.require_ready()
        return state.serving_responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}", responses=answers(401, 404, 503, ok=DeletedResponse))
    async def delete_response(response_id: str) -> Response:
        state.require_ready()
        return state.serving_responses.delete(response_id)

    @app.post("/v1/embeddings", responses=answers(401, 404, 413))
    async def embeddings() -> Response:
        raise RequestError(
            f"`{state.args.model_name}` is a text-generation model: this server serves no "
            "embeddings",
            HTTPStatus.NOT_FOUND,
            param="model",
            code="model_not_supported",
        )

    @app.post("/generate", responses=answers(*GENERATION_ERRORS, ok=GENERATE_ANSWER, ok_media=SSE))
    async def generate(raw_request: Request) -> Response:
        state.require_ready()
        body = await _json_body(raw_request)
        return await state.serving_generate.handle_request(body, raw_request)

    @app.post("/abort_request", responses=ABORT_ANSWERS)
    async def abort_request(raw_request: Request) -> Response:
        tm = state.require_ready()
        body = await _json_body(raw_request)
        rid = body.get("rid")
        abort_all = body.get("abort_all")
        abort_all = False if abort_all is None else abort_all  # null: not sent
        # Strict types: `"abort_all": "false"` must not read as true and abort everything.
        if not isinstance(abort_all, bool):
            raise RequestError("abort_all must be true or false", param="abort_all")
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise RequestError("rid must be a non-empty string", param="rid")
        rid = rid or ""
        if not rid and not abort_all:
            raise RequestError("rid or abort_all is required", param="rid")
        if abort_all:
            require_admin(raw_request, state.args.keys, param="abort_all")
        found = tm.abort_request(str(rid), abort_all)
        return JSONResponse({"success": found}, status_code=200 if found else 404)

    @app.post("/flush_cache", responses=answers(400, 401, 403, 503, ok=OBJECT))
    async def flush_cache() -> Response:
        tm = state.require_ready()
        out = await tm.flush_cache()
        status = 200 if out.success else 400
        return JSONResponse({"success": out.success, "message": out.message}, status_code=status)

    @app.post("/load_lora_adapter", responses=answers(400, 401, 403, 404, 409, 503, ok=OBJECT))
    @app.post("/v1/load_lora_adapter", responses=answers(400, 401, 403, 404, 409, 503, ok=OBJECT))
    async def load_lora_adapter(body: LoadLoraAdapter) -> Response:
        out = await state.require_ready().lora.load(body.lora_name, body.lora_path)
        return _lora_answer(out, f"loaded {body.lora_name!r}", "lora_path")

    @app.post("/unload_lora_adapter", responses=answers(400, 401, 403, 404, 503, ok=OBJECT))
    @app.post("/v1/unload_lora_adapter", responses=answers(400, 401, 403, 404, 503, ok=OBJECT))
    async def unload_lora_adapter(body: UnloadLoraAdapter) -> Response:
        """Answers once the adapter's running and queued requests are done and it is gone."""
        out = await state.require_ready().lora.unload(body.lora_name)
        return _lora_answer(out, f"unloaded {body.lora_name!r}", "lora_name")

    honest_openapi(app, {"/generate": GenerateRequest, "/abort_request": AbortRequest})
    asgi: Any = BodyGuardMiddleware(app, state.max_request_body_bytes)
    if state.args.dp_rank is not None:
        asgi = RankHeaderMiddleware(asgi, state.args.dp_rank)
    asgi = ApiKeyMiddleware(asgi, state.args.keys, OPEN_PATHS, ADMIN_PATHS)
    # Outermost, so that rejected (401) requests are counted and carry their id too.
    return RequestIdMiddleware(HttpMetricsMiddleware(asgi, state.metrics), access_log=True)


def _health(state: ServerState) -> tuple[bool, str]:
    if state.phase != "ready":
        return False, state.reason or state.phase
    liveness = state.tokenizer_manager.liveness
    problem = liveness.problem(time.monotonic(), HEARTBEAT_STALE_S, state.args.watchdog_timeout)
    return (False, problem) if problem is not None else (True, "")


class LoadLoraAdapter(BaseModel):
    """The body of `/load_lora_adapter` (vLLM's and SGLang's)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, pattern=r"^[^:]+$")
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)


def _lora_answer(out: LoraAdapterOut, done: str, param: str) -> Response:
    if not out.success:
        raise RequestError(out.message, out.status_code, param=param)
    return JSONResponse({"success": True, "message": done})


def _model_cards(state: ServerState) -> list[dict[str, Any]]:
    """The served model, then each LoRA adapter with its base as `parent` (as vLLM lists them)."""
    base = {
        "id": state.args.model_name,
        "object": "model",
        "created": int(state.started_time),
        "owned_by": "berth",
        # What the server was started with, not where it resolved to (a cache path on its disk).
        "root": state.args.model,
        "parent": None,
        "max_model_len": state.engine_info.get("context_len"),
    }
    cards = [base]
    if state.phase == "ready":
        for name, path in state.tokenizer_manager.lora.adapters.items():
            cards.append({**base, "id": name, "root": path, "parent": base["id"]})
    return cards


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body
