"""`berth router`: the FastAPI app in front of the DP ranks, and its uvicorn entry point."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict

from berth_common.auth import ApiKeyMiddleware, require_admin
from berth_common.body_guard import BodyGuardMiddleware
from berth_common.errors import RequestError
from berth_common.http import (
    DrainingServer,
    RequestIdMiddleware,
    add_error_handlers,
    error_response,
    uvicorn_config,
)
from berth_common.logging import configure_logging
from berth_common.openapi import (
    METRICS_ANSWER,
    OBJECT,
    SSE,
    answers,
    honest_openapi,
    plain_answers,
)
from berth_common.process import set_process_title
from berth_common.response_ids import rank_of_response
from berth_router import __version__
from berth_router.args import RouterArgs
from berth_router.discovery import DiscoveryError, EndpointSliceDiscovery, KubeConfig
from berth_router.metrics import RouterMetrics
from berth_router.policies import make_policy
from berth_router.proxy import ProxyResponse, Router
from berth_router.signals import RouteSignals, SignalError, read_signals
from berth_router.workers import WorkerRegistry

logger = logging.getLogger(__name__)

# Probes and scrapers need no API key.
OPEN_PATHS = frozenset({"/health", "/liveness", "/readiness", "/metrics"})
# As on the ranks (which check the same key again): the whole-server routes need the admin key.
ADMIN_PATHS = frozenset({"/flush_cache"})
# What the OpenAPI document says each route answers (berth_common.openapi). A forwarded route
# answers what the rank answers, plus the router's own 502, 503 and 504.
FORWARD_ERRORS = (401, 500, 502, 503, 504)
GENERATION_ANSWERS = answers(400, 404, 413, *FORWARD_ERRORS, ok={}, ok_media=SSE)
PROBE_ANSWERS: dict[int | str, Any] = plain_answers(answers(ok=OBJECT), {503: "Not ready"})
ABORT_ANSWERS = plain_answers(
    answers(400, 401, 403, 413, ok=OBJECT), {404: "No rank is running such a request"}
)
STORED_ANSWERS = answers(400, 404, *FORWARD_ERRORS, ok=OBJECT)
FLUSH_ANSWERS = plain_answers(answers(401, 403, ok=OBJECT), {400: "A rank could not flush"})


class ForwardedBody(BaseModel):
    """A JSON object, passed to a rank, which checks it against its own document (the rank's
    `/openapi.json` describes each field)."""

    model_config = ConfigDict(extra="allow")


FANOUT_TIMEOUT_S = 10.0


def create_app(args: RouterArgs, kube: KubeConfig | None = None) -> Any:
    """The router's ASGI app; `kube` is required with --discover-selector."""
    metrics = RouterMetrics()
    policy = make_policy(
        args.policy,
        cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        max_tree_chars=args.max_tree_chars,
    )
    # Every policy polls /get_load: it also says which LoRA adapters each rank serves, which
    # requests for an adapter are routed by (`proxy.adapter_affinity`) whatever the policy.
    registry = WorkerRegistry(args, metrics, poll_load=True, on_rank_reset=policy.forget_rank)
    router = Router(args, registry, policy, metrics)
    if args.discovery and kube is None:
        raise ValueError("--discover-selector needs a Kubernetes API configuration")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks: list[asyncio.Task[None]] = []
        discovery = None
        registry.start()
        if kube is not None and args.discover_selector is not None:
            discovery = EndpointSliceDiscovery(
                kube,
                args.discover_selector,
                args.discover_rank_label,
                args.discover_port_name,
                registry.update,
            )
            tasks.append(asyncio.create_task(discovery.run(), name="router-discovery"))
            tasks.append(asyncio.create_task(registry.initial_checks(), name="router-initial"))
            logger.info(
                "Discovering ranks in namespace %s with selector %s",
                kube.namespace,
                args.discover_selector,
            )
        else:
            registry.set_static(args.worker_urls)
            # Check every rank once before taking traffic, so the first requests find them.
            await registry.initial_checks()
        logger.info("Routing with policy %s on http://%s:%d", policy.name, args.host, args.port)
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await router.close()
            await registry.close()
            if discovery is not None:
                await discovery.close()

    app = FastAPI(title="Berth router", version=__version__, lifespan=lifespan)
    app.state.router = router

    add_error_handlers(app, "router error")

    # --- the router's own endpoints -------------------------------------------------------------

    @app.get("/health", responses=PROBE_ANSWERS)
    async def health() -> Response:
        routable = registry.routable()
        body = {
            "status": "ok" if routable else "unavailable",
            "healthy_ranks": [w.rank for w in routable],
            "ranks": registry.ranks(),
        }
        if not routable:
            body["reason"] = "no rank is known yet" if not registry.workers else "no healthy rank"
        return JSONResponse(body, status_code=200 if routable else 503)

    @app.get("/liveness", responses=answers(ok=OBJECT))
    async def liveness() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/readiness", responses=PROBE_ANSWERS)
    async def readiness() -> Response:
        if registry.synced.is_set() and registry.checked.is_set():
            return JSONResponse({"status": "ok"})
        phase = "discovering ranks" if not registry.synced.is_set() else "checking ranks"
        return JSONResponse({"status": "starting", "reason": phase}, status_code=503)

    @app.get("/workers", responses=answers(401, ok=OBJECT))
    async def workers() -> Response:
        return JSONResponse({"policy": policy.name, "workers": registry.describe()})

    @app.get("/metrics", response_class=PlainTextResponse, responses=METRICS_ANSWER)
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # --- proxied -------------------------------------------------------------------------------

    def forward(
        request: Request, body: bytes, signals: RouteSignals | None, endpoint: str
    ) -> Response:
        """Send the request on as it came: to the rank its signals choose (None: any rank)."""
        return ProxyResponse(
            router,
            method=request.method,
            path=_wire_path(request),
            query=request.url.query,
            headers=request.headers.raw,
            body=body,
            signals=signals,
            endpoint=endpoint,
        )

    async def generation(request: Request, endpoint: str) -> Response:
        body = await request.body()
        try:
            signals = read_signals(request.url.path, body, request.headers)
        except SignalError as e:
            metrics.requests.labels("none", endpoint, "400").inc()
            return error_response(RequestError(e.message, 400, param=e.param))
        return forward(request, body, signals, endpoint)

    def stored_response(request: Request, response_id: str) -> Response:
        """A stored response lives on the rank that made it: its id names that rank."""
        rank = rank_of_response(response_id)
        pinned = None if rank is None else RouteSignals(pinned_rank=rank, pinned_by="response_id")
        return forward(request, b"", pinned, "/v1/responses/{id}")

    async def anywhere(request: Request, endpoint: str) -> Response:
        return forward(request, await request.body(), None, endpoint)

    @app.post("/v1/chat/completions", responses=GENERATION_ANSWERS)
    async def chat_completions(request: Request) -> Response:
        return await generation(request, "/v1/chat/completions")

    @app.post("/v1/completions", responses=GENERATION_ANSWERS)
    async def completions(request: Request) -> Response:
        return await generation(request, "/v1/completions")

    @app.post("/v1/responses", responses=GENERATION_ANSWERS)
    async def create_response(request: Request) -> Response:
        return await generation(request, "/v1/responses")

    @app.get("/v1/responses/{response_id}", responses=STORED_ANSWERS)
    async def retrieve_response(request: Request, response_id: str) -> Response:
        return stored_response(request, response_id)

    @app.delete("/v1/responses/{response_id}", responses=STORED_ANSWERS)
    async def delete_response(request: Request, response_id: str) -> Response:
        return stored_response(request, response_id)

    @app.post("/generate", responses=GENERATION_ANSWERS)
    async def generate(request: Request) -> Response:
        return await generation(request, "/generate")

    @app.get("/v1/models", responses=answers(*FORWARD_ERRORS, ok=OBJECT))
    async def models(request: Request) -> Response:
        return await anywhere(request, "/v1/models")

    @app.get("/v1/models/{model:path}", responses=answers(404, *FORWARD_ERRORS, ok=OBJECT))
    async def model(request: Request, model: str) -> Response:
        return await anywhere(request, "/v1/models/{model}")

    @app.get("/get_model_info", responses=answers(*FORWARD_ERRORS, ok=OBJECT))
    async def model_info(request: Request) -> Response:
        return await anywhere(request, "/get_model_info")

    @app.post("/abort_request", responses=ABORT_ANSWERS)
    async def abort_request(request: Request) -> Response:
        """The router does not know which rank holds a rid: ask every rank."""
        if await _asks_abort_all(request):
            require_admin(request, args.keys, param="abort_all")
        results = await _fanout(router, request, "/abort_request")
        found = any(status == 200 for status, _ in results.values())
        return JSONResponse({"success": found}, status_code=200 if found else 404)

    @app.post("/flush_cache", responses=FLUSH_ANSWERS)
    async def flush_cache(request: Request) -> Response:
        """Flush every rank's prefix cache; the router forgets what it thought they held."""
        results = await _fanout(router, request, "/flush_cache")
        ok = bool(results) and all(status == 200 for status, _ in results.values())
        if ok:
            policy.reset()
        ranks = {str(rank): body for rank, (_, body) in sorted(results.items())}
        return JSONResponse({"success": ok, "ranks": ranks}, status_code=200 if ok else 400)

    honest_openapi(
        app,
        {
            "/v1/chat/completions": ForwardedBody,
            "/v1/completions": ForwardedBody,
            "/generate": ForwardedBody,
            "/v1/responses": ForwardedBody,
            "/abort_request": ForwardedBody,
        },
    )
    body_limit = int(args.max_request_body_mb * 2**20)
    asgi: Any = BodyGuardMiddleware(app, lambda: body_limit)
    asgi = ApiKeyMiddleware(asgi, args.keys, OPEN_PATHS, ADMIN_PATHS)
    return RequestIdMiddleware(asgi, access_log=args.log_level == "debug")


def _wire_path(request: Request) -> str:
    """The path as the client sent it, still percent-encoded: a decoded one (`/v1/models/%1C`
    -> a control character) is no longer a valid URL to send on."""
    raw = request.scope.get("raw_path")
    return raw.decode("latin-1") if raw else request.url.path


async def _asks_abort_all(request: Request) -> bool:
    """Whether an abort body asks for everything (the ranks validate the rest themselves)."""
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("abort_all") is True


async def _fanout(router: Router, request: Request, path: str) -> dict[int, tuple[int, Any]]:
    """Send the same request to every healthy rank; {rank: (status, JSON body or text)}."""
    body = await request.body()
    headers = {
        k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")
    }

    async def one(url: str) -> tuple[int, Any]:
        try:
            response = await router.client.request(
                request.method,
                f"{url}{path}",
                content=body,
                headers=headers,
                timeout=FANOUT_TIMEOUT_S,
            )
        except httpx.HTTPError as e:
            return 502, {"error": f"{type(e).__name__}: {e}"}
        try:
            return response.status_code, response.json()
        except ValueError:
            return response.status_code, response.text

    workers = [w for w in router.registry.routable() if w.url is not None]
    results = await asyncio.gather(*(one(w.url) for w in workers if w.url))
    return {w.rank: result for w, result in zip(workers, results)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="berth router",
        description="Route OpenAI-compatible requests over Berth's data-parallel ranks "
        "(prefix-cache aware), with health checks, retries, pinning and streaming.",
    )
    RouterArgs.add_cli_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`berth router ...`: parse the flags, then serve until SIGTERM / SIGINT."""
    parser = build_parser()
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        args = RouterArgs.from_cli_args(ns)
    except ValueError as e:
        parser.error(str(e))
    if not args.worker_urls and not args.discovery:
        parser.error("give the ranks: --worker-urls URL ... or --discover-selector SELECTOR")
    kube = None
    if args.discovery:
        try:
            kube = KubeConfig.from_environment(args.kube_api_url, args.discover_namespace)
        except DiscoveryError as e:
            parser.error(str(e))
    return run_router(args, kube)


def run_router(args: RouterArgs, kube: KubeConfig | None = None) -> int:
    configure_logging(args.log_level, "router")
    set_process_title("router")
    app = create_app(args, kube)
    config = uvicorn_config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # SIGTERM: stop accepting, let streams in flight finish for this long.
        graceful_shutdown_s=int(args.graceful_shutdown_timeout),
        access_log=False,
    )
    server = DrainingServer(config)
    server.run()
    if not server.started:
        return 1  # e.g. the port was taken
    logger.info("Router stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
