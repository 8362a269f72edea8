"""GET /v1/server-info: what the server runs and how (an operational endpoint plugin).

Answers the served model, its tasks and context length, whether the engine is alive and
how busy it is (requests in flight, running and waiting, KV-cache use), the engine
configuration (batch caps, KV-cache budget, parallelism), the gateway version, the
uptime, and a summary of the plugin load report of every process. `required_tasks` is None:
it attaches on every model. It uses the engine client only to read state, never to
generate.

Enable it with `VLLM_PLUGINS=server_info` (endpoint plugins load only when named).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import msgspec
from fastapi import APIRouter, FastAPI

import gateway
from gateway.plugins import load_report


class ServerInfoPlugin:
    """The endpoint plugin (the object the entry point's factory returns)."""

    name = "server_info"
    required_tasks: tuple[str, ...] | None = None

    def __init__(self) -> None:
        self.engine_client: Any = None
        self.started_at = time.time()

    def attach_router(self, app: FastAPI) -> None:
        router = APIRouter(tags=["server-info"])
        router.add_api_route("/v1/server-info", self.server_info, methods=["GET"],
                             summary="The served model, engine state and configuration")
        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        self.engine_client = engine_client
        self.started_at = time.time()

    async def server_info(self) -> dict[str, Any]:
        engine = self.engine_client
        config = getattr(engine, "config", None)
        return {
            "gateway_version": gateway.__version__,
            "uptime_s": round(time.time() - self.started_at, 3),
            "model": engine.model_name,
            "supported_tasks": list(engine.supported_tasks),
            "max_model_len": engine.max_model_len,
            "engine": _engine_state(engine),
            "config": msgspec.to_builtins(config) if config is not None else None,
            "plugins": _plugin_summary(load_report().to_dicts() + list(engine.plugin_reports())),
        }


def _engine_state(engine: Any) -> dict[str, Any]:
    """Liveness, the requests the front end has in flight, and the scheduler's last stats
    (running and waiting requests, KV-cache use)."""
    stats = getattr(engine, "latest_stats", None)
    scheduler = None if stats is None else _fields(stats)
    return {"alive": not engine.is_dead, "dead_reason": engine.dead_reason,
            "num_inflight_requests": getattr(engine, "num_inflight_requests", None),
            "scheduler": scheduler}


def _fields(struct: msgspec.Struct) -> dict[str, Any]:
    """A stats struct as a JSON object, nested ones (prefix-cache stats) too."""
    fields = {name: getattr(struct, name) for name in struct.__struct_fields__}
    return {name: _fields(value) if isinstance(value, msgspec.Struct) else value
            for name, value in fields.items()}


def _plugin_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    by_outcome = Counter(str(r.get("outcome")) for r in records)
    attached = sorted(r["name"] for r in records if r.get("outcome") == "attached")
    return {"records": len(records), "by_outcome": dict(sorted(by_outcome.items())),
            "attached_endpoints": attached}


def make_plugin() -> ServerInfoPlugin:
    """The `vllm.endpoint_plugins` entry point: a zero-argument factory."""
    return ServerInfoPlugin()
