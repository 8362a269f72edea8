"""What one app's routes and middleware read, typed: `ServerState`, made by `build_app` and
kept as `app.state.server` (front-end process).

The routes reach it with `server_state(request)`, the serving loop with `app_state(app)`;
the middleware that need a part of it (the plugins' routes, the drain) are given that part
when the app is built.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request

from gateway.frontend.endpoint_plugins import AttachedPlugin
from gateway.frontend.http.reliability import Reliability
from gateway.frontend.openai.chat_parsers import ChatParsers
from gateway.frontend.openai.lora import LoRAAdapters
from gateway.frontend.openai.responses_store import ResponseStore
from gateway.frontend.openai.serving import ServingOptions
from gateway.frontend.server_config import ServerConfig
from gateway.plugins import EngineClient, IOProcessor


class TracerProvider(Protocol):
    """The OpenTelemetry tracer provider, with --otlp-traces-endpoint."""

    def shutdown(self) -> None:
        """Send the last spans (the server calls it once, at exit)."""


class PeerProcesses(Protocol):
    """The other processes of a `gateway serve --api-server-count N` (the supervisor's
    shared folder, scaling/shared_dir.py): their load reports and pids, and this process's
    report, published for them."""

    def peer_records(self) -> list[dict[str, Any]]: ...

    def peer_pids(self) -> dict[str, int]: ...

    def publish_report(self) -> None: ...


@dataclass
class ServerState:
    config: ServerConfig
    engine_client: EngineClient
    #: The engine's tasks, plus `plugin` while an IO processor is active.
    supported_tasks: tuple[str, ...]
    serving_options: ServingOptions
    chat_parsers: ChatParsers
    #: The IO processor `/pooling` runs (rule 8), if any.
    io_processor: IOProcessor[Any, Any] | None
    #: What /metrics renders.
    metrics_registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    #: The drain, the event-loop watchdog and the request tracker.
    reliability: Reliability | None = None
    tracer_provider: TracerProvider | None = None
    #: The other API servers, with --api-server-count N.
    peers: PeerProcesses | None = None
    #: The /v1/responses answers kept for previous_response_id.
    responses_store: ResponseStore = field(default_factory=ResponseStore)
    #: The LoRA adapters served by name (--enable-lora), and the resolvers' finds.
    lora_adapters: LoRAAdapters = field(
        default_factory=lambda: LoRAAdapters(None, "", None))
    #: The endpoint plugins attached, then (after their init_state) those that serve.
    endpoint_plugins: list[AttachedPlugin] = field(default_factory=list)
    started_at: int = field(default_factory=lambda: int(time.time()))

    def peer_records(self) -> list[dict[str, Any]]:
        """The other API servers' and the supervisor's load-report records."""
        return self.peers.peer_records() if self.peers is not None else []

    def peer_pids(self) -> dict[str, int]:
        return self.peers.peer_pids() if self.peers is not None else {}


def server_state(request: Request) -> ServerState:
    """The state of the app serving `request`."""
    return app_state(request.app)


def app_state(app: Starlette) -> ServerState:
    """The state `build_app` made for `app`."""
    state: ServerState = app.state.server
    return state
