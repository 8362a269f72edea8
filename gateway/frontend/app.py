"""The FastAPI app of the front end, assembled in one place: `build_app(config,
engine_client, ...)`.

Runs in the API-server process only. Nothing here (or below it) imports torch, a worker,
a model or the engine core: the engine is reached through `engine_client` alone.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

import gateway
from gateway import envs
from gateway.frontend import core_routes
from gateway.frontend.endpoint_plugins import (
    attach_endpoint_plugins,
    init_endpoint_plugins,
)
from gateway.frontend.http.auth import APIKeyMiddleware, public_paths
from gateway.frontend.http.errors import install_error_handlers
from gateway.frontend.http.middleware import (
    BodySizeLimitMiddleware,
    ConcurrencyLimitMiddleware,
    RequestIdMiddleware,
)
from gateway.frontend.http.reliability import attach_reliability
from gateway.frontend.http.unicode_guard import LoneSurrogateMiddleware
from gateway.frontend.openai import (
    chat,
    classify,
    completions,
    embeddings,
    lora_routes,
    pooling,
    responses,
    serving_score,
    tokenize,
)
from gateway.frontend.openai.chat_parsers import ChatParsers
from gateway.frontend.openai.lora import LoRAAdapters
from gateway.frontend.openai.responses_store import ResponseStore
from gateway.frontend.openai.serving import make_serving_options
from gateway.frontend.server_config import HttpConfig, ServerConfig
from gateway.frontend.server_state import PeerProcesses, ServerState, TracerProvider, app_state
from gateway.metrics.attach import attach_metrics
from gateway.metrics.manager import StatLoggerManager
from gateway.metrics.registry import make_registries
from gateway.plugins import EngineClient, IOProcessor, load_endpoint_plugins

#: Core routers by the task that needs them (the HTTP surface in the README). A model gets the
#: routers of every task it supports, each once; "*" is every model. `plugin` is the task an
#: active IO processor adds. An embedding model scores pairs too (cosine similarity, as vLLM
#: does); a cross-encoder (task `score`) by its classifier.
ROUTERS_BY_TASK: dict[str, list[APIRouter]] = {
    "*": [core_routes.router],
    "generate": [completions.router, chat.router, responses.router, tokenize.router],
    "embed": [embeddings.router, pooling.router, tokenize.router, serving_score.router],
    "classify": [classify.router, tokenize.router],
    "score": [serving_score.router, tokenize.router],
    "plugin": [pooling.router],
}


def core_routers(supported_tasks: Iterable[str]) -> list[APIRouter]:
    """The core routers for a model with `supported_tasks`, in a stable order."""
    routers: list[APIRouter] = []
    for task in ("*", *supported_tasks):
        for router in ROUTERS_BY_TASK.get(task, []):
            if router not in routers:
                routers.append(router)
    return routers


def create_core_app(http: HttpConfig, supported_tasks: Iterable[str], *,
                    on_unhandled_error: Callable[[Any, BaseException], None] | None = None,
                    ) -> FastAPI:
    """The app with its middleware, error handlers and core routes, and no plugin.

    Needs no engine (the routes reach it through the app's `ServerState` per request), so
    the preflight (`gateway plugins --check`) can apply the route-conflict rules to it.
    """
    docs_off = http.disable_fastapi_docs
    app = FastAPI(
        title="gateway", version=gateway.__version__, lifespan=_lifespan,
        openapi_url=None if docs_off else "/openapi.json",
        docs_url=None if docs_off else "/docs", redoc_url=None if docs_off else "/redoc",
        middleware=_middleware(http, on_unhandled_error),
    )
    install_error_handlers(app)
    for router in core_routers(supported_tasks):
        # Route by route (not `include_router`), so that a plugin can replace one of them.
        app.router.routes.extend(router.routes)
    return app


def build_app(config: ServerConfig, engine_client: EngineClient, *,
              stat_loggers: StatLoggerManager | None = None,
              io_processor: IOProcessor[Any, Any] | None = None,
              peers: PeerProcesses | None = None,
              on_unhandled_error: Callable[[Any, BaseException], None] | None = None,
              ) -> FastAPI:
    """The front end's whole app for a running engine, in the order the plugin rules give.

    1. Core routes (the README's list), only those the served tasks support: the engine's
       `engine_client.supported_tasks`, plus `plugin` when `io_processor` (the instance
       rule 8 chose, which `/pooling` runs) is given; with the HTTP middleware (below).
    2. Endpoint plugins, in discovery order, each `attach_router` isolated, with the
       route-conflict rules: a plugin route on a core route's path and method replaces it;
       two plugins on one path and method raise `PluginError` (start-up stops).
    3. Metrics: /metrics renders `stat_loggers`' registries with the gateway's own
       collectors and the HTTP and plugin-route metrics middleware (metrics/attach.py);
       without `stat_loggers`, a fresh registry.
    4. Reliability: the drain, the event-loop watchdog, --plugin-route-timeout, the stall
       and load-shedding metrics (http/reliability.py).
    5. Tracing, with --otlp-traces-endpoint (http/tracing.py).
    At start-up (the app's lifespan, before the server accepts requests), each plugin's
    `init_state(engine_client, app.state, config.args)`, isolated; the ones that fail lose
    their routes; then this process's load report is published to `peers` (the other API
    servers), if any.

    Everything the routes read is the app's `ServerState` (`server_state(request)`).
    `on_unhandled_error(scope, exc)` is called for each exception no handler answered (a
    plugin route that raised), e.g. to count it.

    Middleware, outermost first: tracing, the reliability middleware, the metrics
    middleware, then request id (and the last-resort 500), CORS (preflights answered here,
    before the key is checked), concurrency limit (`limit_concurrency`), API key, body size
    limit, lone-surrogate refusal; all raw ASGI.
    """
    tasks = served_tasks(engine_client.supported_tasks, io_processor)
    app = create_core_app(config.http, tasks, on_unhandled_error=on_unhandled_error)
    model_path = engine_client.model_info.path if engine_client.model_info is not None \
        else None
    state = ServerState(config, engine_client, tasks,
                        make_serving_options(config.openai, model_path,
                                             config.reliability.max_num_queued_reqs),
                        ChatParsers.from_config(config.openai),  # --tool-call-parser etc.
                        io_processor, peers=peers,
                        responses_store=ResponseStore(
                            config.openai.responses_store_max_entries,
                            config.openai.responses_store_max_age_s))
    state.lora_adapters = LoRAAdapters.from_modules(
        config.engine.lora, engine_client.model_name, engine_client.model_info,
        list(config.openai.lora_modules))
    if "generate" in tasks and envs.allow_runtime_lora_updating():  # vLLM's rule
        app.router.routes.extend(lora_routes.router.routes)
    app.state.server = state
    app.state.engine_client = engine_client  # vLLM's name, for plugin routes
    state.endpoint_plugins = attach_endpoint_plugins(app, load_endpoint_plugins(tasks))
    registries = stat_loggers.registries if stat_loggers is not None else make_registries()
    state.metrics_registry = registries.exposition
    if stat_loggers is not None:
        attach_metrics(app, state, stat_loggers)
    state.reliability = attach_reliability(app, engine_client, config.reliability,
                                           registries, lambda: state.endpoint_plugins)
    endpoint = config.observability.otlp_traces_endpoint
    if endpoint:
        state.tracer_provider = _attach_tracing(app, state, endpoint)
    return app


def served_tasks(engine_tasks: Iterable[str], io_processor: object | None) -> tuple[str, ...]:
    """The server's tasks: the engine's, plus `plugin` while an IO processor is active."""
    tasks = tuple(engine_tasks)
    return tasks + ("plugin",) if io_processor is not None and "plugin" not in tasks else tasks


class TracingUnavailableError(RuntimeError):
    """--otlp-traces-endpoint without the OpenTelemetry SDK installed."""


def _attach_tracing(app: FastAPI, state: ServerState, endpoint: str) -> TracerProvider:
    try:
        from gateway.frontend.http.tracing import attach_tracing
    except ImportError as exc:
        raise TracingUnavailableError(
            f"--otlp-traces-endpoint needs the OpenTelemetry SDK ({exc.name} is missing): "
            "pip install 'gateway[tracing]'") from None
    return attach_tracing(app, state.engine_client, endpoint, lambda: state.endpoint_plugins)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state = app_state(app)
    state.endpoint_plugins = await init_endpoint_plugins(
        app, state.endpoint_plugins, state.engine_client, state.config.args)
    if state.peers is not None:  # one of several API servers
        state.peers.publish_report()  # the outcomes of init_state, before the first request
    yield


def _cors_middleware(http: HttpConfig) -> Middleware:
    """vLLM's CORS flags through Starlette's middleware. It sits outside the API-key
    check, so a browser's preflight (which carries no key) is answered, and error
    responses carry the CORS headers too."""
    return Middleware(CORSMiddleware,
                      allow_origins=list(http.allowed_origins) or ["*"],
                      allow_methods=list(http.allowed_methods) or ["*"],
                      allow_headers=list(http.allowed_headers) or ["*"],
                      allow_credentials=http.allow_credentials)


def _middleware(http: HttpConfig,
                on_unhandled_error: Callable[[Any, BaseException], None] | None
                ) -> list[Middleware]:
    stack = [Middleware(RequestIdMiddleware, on_unhandled_error=on_unhandled_error),
             _cors_middleware(http)]
    if http.limit_concurrency:
        stack.append(Middleware(ConcurrencyLimitMiddleware, limit=http.limit_concurrency))
    if http.api_key:
        public = public_paths(http.protect_metrics)
        stack.append(Middleware(APIKeyMiddleware, api_key=http.api_key, public=public))
    stack.append(Middleware(BodySizeLimitMiddleware, max_body_bytes=http.max_request_body_bytes))
    stack.append(Middleware(LoneSurrogateMiddleware))
    return stack
