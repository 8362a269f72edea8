"""The FastAPI app of the front end: `build_app(args, engine_client)`.

Runs in the API-server process only. Nothing here (or below it) imports torch, a worker,
a model or the engine core: the engine is reached through `engine_client` alone.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from prometheus_client import CollectorRegistry
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

import gateway
from gateway import envs
from gateway.frontend import core_routes
from gateway.frontend.endpoint_plugins import (
    AttachedPlugin,
    attach_endpoint_plugins,
    init_endpoint_plugins,
)
from gateway.frontend.http.auth import APIKeyMiddleware, public_paths
from gateway.frontend.http.errors import install_error_handlers
from gateway.frontend.http.middleware import (
    DEFAULT_MAX_BODY_BYTES,
    BodySizeLimitMiddleware,
    ConcurrencyLimitMiddleware,
    RequestIdMiddleware,
)
from gateway.frontend.http.unicode_guard import LoneSurrogateMiddleware
from gateway.frontend.openai import (
    chat,
    classify,
    completions,
    embeddings,
    pooling,
    serving_score,
    tokenize,
)
from gateway.frontend.openai.chat_parsers import ChatParsers
from gateway.frontend.openai.serving import make_serving_options
from gateway.plugins import IOProcessor, load_endpoint_plugins

#: Core routers by the task that needs them (the HTTP surface in the README). A model gets the
#: routers of every task it supports, each once; "*" is every model. `plugin` is the task an
#: active IO processor adds. An embedding model scores pairs too (cosine similarity, as vLLM
#: does); a cross-encoder (task `score`) by its classifier.
ROUTERS_BY_TASK: dict[str, list[APIRouter]] = {
    "*": [core_routes.router],
    "generate": [completions.router, chat.router, tokenize.router],
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


def create_core_app(args: argparse.Namespace, supported_tasks: Iterable[str], *,
                    on_unhandled_error: Callable[[Any, BaseException], None] | None = None,
                    ) -> FastAPI:
    """The app with its middleware, error handlers and core routes, and no plugin.

    Needs no engine (the routes reach it through `app.state.engine_client` per request), so
    the preflight (`gateway plugins --check`) can apply the route-conflict rules to it.
    """
    docs_off = bool(getattr(args, "disable_fastapi_docs", False))
    app = FastAPI(
        title="gateway", version=gateway.__version__, lifespan=_lifespan,
        openapi_url=None if docs_off else "/openapi.json",
        docs_url=None if docs_off else "/docs", redoc_url=None if docs_off else "/redoc",
        middleware=_middleware(args, on_unhandled_error),
    )
    install_error_handlers(app)
    for router in core_routers(supported_tasks):
        # Route by route (not `include_router`), so that a plugin can replace one of them.
        app.router.routes.extend(router.routes)
    app.state.args = args
    app.state.metrics_registry = CollectorRegistry()
    app.state.started_at = int(time.time())
    app.state.endpoint_plugins = []
    return app


def build_app(args: argparse.Namespace, engine_client: Any, *,
              metrics_registry: CollectorRegistry | None = None,
              on_unhandled_error: Callable[[Any, BaseException], None] | None = None,
              io_processor: IOProcessor[Any, Any] | None = None,
              ) -> FastAPI:
    """Build the front end's app for a running engine.

    1. Core routes (the README's list), only those the served tasks support: the engine's
       `engine_client.supported_tasks`, plus `plugin` when `io_processor` (the instance
       rule 8 chose, which `/pooling` runs) is given.
    2. Endpoint plugins, in discovery order, each `attach_router` isolated, with the
       route-conflict rules: a plugin route on a core route's path and method replaces it;
       two plugins on one path and method raise `PluginError` (start-up stops).
    3. At start-up (the app's lifespan, before the server accepts requests), each plugin's
       `init_state(engine_client, app.state, args)`, isolated; the ones that fail lose
       their routes.

    `args` are the parsed `gateway serve` flags (`api_key` (else VLLM_API_KEY),
    `protect_metrics`, `disable_fastapi_docs`, `max_request_body_bytes`; all optional; the
    root path is the HTTP server's setting). `metrics_registry` is the Prometheus registry
    that /metrics renders (a fresh one when None). `on_unhandled_error(scope, exc)` is
    called for each exception no handler answered (a plugin route that raised), e.g. to
    count it.

    Middleware, outermost first: request id (and the last-resort 500), CORS (preflights
    answered here, before the key is checked), concurrency limit (`limit_concurrency`), API
    key, body size limit, lone-surrogate refusal; all raw ASGI.
    """
    tasks = served_tasks(engine_client.supported_tasks, io_processor)
    app = create_core_app(args, tasks, on_unhandled_error=on_unhandled_error)
    app.state.engine_client = engine_client
    model_info = getattr(engine_client, "model_info", None)
    app.state.serving_options = make_serving_options(
        args, getattr(model_info, "path", None))
    app.state.chat_parsers = ChatParsers.from_args(args)  # --tool-call-parser etc.
    app.state.io_processor = io_processor
    app.state.supported_tasks = tasks
    if metrics_registry is not None:
        app.state.metrics_registry = metrics_registry
    app.state.endpoint_plugins = attach_endpoint_plugins(app, load_endpoint_plugins(tasks))
    return app


def served_tasks(engine_tasks: Iterable[str], io_processor: object | None) -> tuple[str, ...]:
    """The server's tasks: the engine's, plus `plugin` while an IO processor is active."""
    tasks = tuple(engine_tasks)
    return tasks + ("plugin",) if io_processor is not None and "plugin" not in tasks else tasks


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    attached: list[AttachedPlugin] = app.state.endpoint_plugins
    engine_client = getattr(app.state, "engine_client", None)
    app.state.endpoint_plugins = await init_endpoint_plugins(app, attached, engine_client,
                                                             app.state.args)
    publish = getattr(app.state, "publish_plugin_report", None)  # one of several API servers
    if publish is not None:
        publish()  # the outcomes of init_state, before the first request is accepted
    yield


def _cors_middleware(args: argparse.Namespace) -> Middleware:
    """vLLM's CORS flags through Starlette's middleware. It sits outside the API-key
    check, so a browser's preflight (which carries no key) is answered, and error
    responses carry the CORS headers too."""
    return Middleware(CORSMiddleware,
                      allow_origins=getattr(args, "allowed_origins", None) or ["*"],
                      allow_methods=getattr(args, "allowed_methods", None) or ["*"],
                      allow_headers=getattr(args, "allowed_headers", None) or ["*"],
                      allow_credentials=bool(getattr(args, "allow_credentials", False)))


def _middleware(args: argparse.Namespace,
                on_unhandled_error: Callable[[Any, BaseException], None] | None
                ) -> list[Middleware]:
    stack = [Middleware(RequestIdMiddleware, on_unhandled_error=on_unhandled_error),
             _cors_middleware(args)]
    limit = getattr(args, "limit_concurrency", None)
    if limit:
        stack.append(Middleware(ConcurrencyLimitMiddleware, limit=limit))
    api_key = getattr(args, "api_key", None) or envs.api_key()
    if api_key:
        public = public_paths(bool(getattr(args, "protect_metrics", False)))
        stack.append(Middleware(APIKeyMiddleware, api_key=api_key, public=public))
    max_body = getattr(args, "max_request_body_bytes", None) or DEFAULT_MAX_BODY_BYTES
    stack.append(Middleware(BodySizeLimitMiddleware, max_body_bytes=max_body))
    stack.append(Middleware(LoneSurrogateMiddleware))
    return stack
