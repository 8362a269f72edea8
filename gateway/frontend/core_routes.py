"""Routes every model gets: /health, /ping, /load, /version, /metrics, /v1/models,
/v1/plugins.

/health, /ping, /version and /metrics are public (no API key); /metrics can be protected
with --protect-metrics. Front-end process; each route reads the app's `ServerState`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

import gateway
from gateway.frontend.http.errors import error_response
from gateway.frontend.http.responses import JSONResponse
from gateway.frontend.server_state import server_state
from gateway.plugins import EngineClient, load_report

router = APIRouter()
# What /openapi.json says the probes and /metrics answer (FastAPI would say JSON).
_PROBE: dict[int | str, dict[str, Any]] = {
    200: {"description": "The engine is running (no body)."}}
_EXPOSITION: dict[int | str, dict[str, Any]] = {200: {
    "description": "The Prometheus text exposition.",
    "content": {"text/plain": {"schema": {"type": "string"}}}}}


@router.get("/health", response_class=Response, responses=_PROBE)
async def health(request: Request) -> Response:
    """200 while the engine runs; 503 once it has died, while it is stalled (requests
    pending and no step completing), and while the server drains at shutdown."""
    state = server_state(request)
    engine_client = state.engine_client
    if engine_client.is_dead:
        reason = engine_client.dead_reason or "unknown reason"
        return error_response(503, f"The engine is not running ({reason}).",
                              code="engine_dead")
    if state.reliability is not None and state.reliability.drain.is_draining:
        return error_response(503, "The server is shutting down.", code="shutting_down")
    stalled_reason = engine_client.stalled_reason
    if stalled_reason is not None:
        return error_response(503, f"The engine is stalled: {stalled_reason}.",
                              code="engine_stalled")
    return Response(status_code=200)


@router.get("/ping", response_class=Response, responses=_PROBE)
async def ping(request: Request) -> Response:
    """The same as /health (the SageMaker name)."""
    return await health(request)


@router.post("/ping", response_class=Response, responses=_PROBE)
async def ping_post(request: Request) -> Response:
    """The same as /health (SageMaker pings with POST)."""
    return await health(request)


@router.get("/load")
async def load(request: Request) -> JSONResponse:
    """vLLM's route for load balancers: the requests this server has in flight in the
    engine (`server_load`)."""
    engine_client = server_state(request).engine_client
    return JSONResponse({"server_load": engine_client.num_inflight_requests})


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": gateway.__version__})


@router.get("/metrics", response_class=Response, responses=_EXPOSITION)
async def metrics(request: Request) -> Response:
    """Prometheus exposition of the app's registry (`ServerState.metrics_registry`).

    The stat loggers register their collectors in that registry; this route only renders
    it.
    """
    registry = server_state(request).metrics_registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    """The served model, then its LoRA adapters (parent: the model), in OpenAI's list
    shape."""
    state = server_state(request)
    engine_client = state.engine_client
    card = {"id": engine_client.model_name, "object": "model",
            "created": state.started_at, "owned_by": "gateway",
            "root": _model_root(engine_client), "parent": None,
            "max_model_len": engine_client.max_model_len}
    adapters = state.lora_adapters.cards(state.started_at, engine_client.max_model_len)
    return JSONResponse({"object": "list", "data": [card, *adapters]})


@router.get("/v1/plugins")
async def list_plugins(request: Request) -> JSONResponse:
    """The load report of every process: this front end's records, then the other API
    servers' and the supervisor's (`--api-server-count`), then the engine core's and each
    worker's (each record names its process role and pid)."""
    state = server_state(request)
    records: list[dict[str, Any]] = (load_report().to_dicts() + state.peer_records()
                                     + list(state.engine_client.plugin_reports()))
    return JSONResponse({"object": "list", "data": records})


def _model_root(engine_client: EngineClient) -> str:
    model = engine_client.config.model.model
    return str(model) if model else str(engine_client.model_name)
