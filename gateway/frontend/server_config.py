"""The server's configuration, typed: what `gateway serve`'s flags say, built once from the
parsed arguments (`cli.args.server_config_from_args`) and read by the app, the metrics,
the reliability pieces, the engine client's options and each API-server process.

Front-end process (the supervisor and the API servers; an API server receives it, pickled,
from the supervisor). The engine's own part is the `EngineConfig` the engine core gets.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from gateway.config import EngineConfig
from gateway.frontend.engine_client.liveness import DEFAULT_STALL_THRESHOLD_S
from gateway.frontend.http.connections import DEFAULT_HEADER_TIMEOUT_S
from gateway.frontend.http.middleware import DEFAULT_MAX_BODY_BYTES
from gateway.frontend.openai.lora import LoRAModule
from gateway.frontend.openai.request_templates import DEFAULT_RENDER_TIMEOUT_S
from gateway.frontend.openai.responses_store import DEFAULT_MAX_AGE_S, DEFAULT_MAX_ENTRIES
from gateway.frontend.openai.sampling import DEFAULT_MAX_N, DEFAULT_MAX_SEQS_PER_REQUEST
from gateway.frontend.openai.structured_output_limits import SpecLimits

# The server must not be the side that closes an idle connection: a client reusing it at
# that instant loses its request with no answer (HTTP/1.1 has no way to retry it safely).
# So the timeout is above the idle expiry of common clients (httpx and the openai SDK 5 s,
# aiohttp 15 s) and proxies (nginx upstream keepalive and AWS ALB 60 s): nginx's own 75 s.
# uvicorn's (and vLLM's) 5 s equals httpx's, which loses requests under load
# (docs/operations.md).
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 75
DEFAULT_LOOP_STALL_THRESHOLD_S = 0.25
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class HttpConfig:
    """The HTTP server: where it listens, who may call it, what it accepts."""

    host: str = "127.0.0.1"
    port: int = 8000
    root_path: str = ""
    #: --api-key, else VLLM_API_KEY; None: no key is asked for.
    api_key: str | None = None
    disable_fastapi_docs: bool = False
    protect_metrics: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    limit_concurrency: int | None = None
    timeout_keep_alive_s: int = DEFAULT_TIMEOUT_KEEP_ALIVE_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    uvicorn_log_level: str = "info"
    access_log: bool = True
    # CORS (vLLM's flags).
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # TLS: uvicorn's settings (cert_reqs is Python's ssl.CERT_NONE/OPTIONAL/REQUIRED).
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0

    def __post_init__(self) -> None:
        # Starlette answers a credentialed request from any origin when "*" is allowed, so
        # any website a user visits could call the server with that user's cookies.
        if self.allow_credentials and (not self.allowed_origins or "*" in self.allowed_origins):
            raise ValueError(
                "--allow-credentials cannot be used with --allowed-origins '[\"*\"]' (the "
                "default): any website could call the server with its visitors' credentials; "
                "list the origins to trust, e.g. --allowed-origins "
                "'[\"https://app.example.com\"]'")

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"


@dataclass(frozen=True)
class ReliabilityConfig:
    """Health, load shedding and the drain (docs/reliability.md)."""

    max_num_queued_reqs: int | None = None
    engine_stall_threshold_s: float = DEFAULT_STALL_THRESHOLD_S
    event_loop_stall_threshold_s: float = DEFAULT_LOOP_STALL_THRESHOLD_S
    plugin_route_timeout_s: float | None = None
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S


@dataclass(frozen=True)
class OpenAIConfig:
    """The OpenAI routes' settings: choices, sampling defaults, the chat template, and the
    tool-call and reasoning parsers."""

    max_n: int = DEFAULT_MAX_N
    #: --max-seqs-per-request: a request's prompts x n, at most.
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST
    #: auto (the model's), vllm (the API's own defaults) or a folder.
    generation_config: str = "auto"
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    #: How long a request's own chat_template may render (None: no limit).
    chat_template_render_timeout_s: float | None = DEFAULT_RENDER_TIMEOUT_S
    #: Size caps of a structured-output constraint (--structured-outputs-max-*).
    spec_limits: SpecLimits = field(default_factory=SpecLimits)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    tool_parser_plugin: str | None = None
    reasoning_parser: str | None = None
    #: The responses kept for previous_response_id: how many, and for how long.
    responses_store_max_entries: int = DEFAULT_MAX_ENTRIES
    responses_store_max_age_s: float = DEFAULT_MAX_AGE_S
    #: --lora-modules: the adapters served from start-up (with --enable-lora).
    lora_modules: tuple[LoRAModule, ...] = ()


@dataclass(frozen=True)
class ObservabilityConfig:
    """Logs, request logs, stats and traces."""

    log_format: str = "text"
    enable_log_requests: bool = False
    enable_log_outputs: bool = False
    max_log_len: int | None = None
    disable_log_stats: bool = False
    otlp_traces_endpoint: str | None = None


@dataclass(frozen=True)
class ServerConfig:
    """Everything `gateway serve` was told (see the module doc)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    openai: OpenAIConfig = field(default_factory=OpenAIConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    #: API-server processes sharing the port (--api-server-count).
    api_server_count: int = 1
    #: Only this node's worker ranks, no server (--headless).
    headless: bool = False
    #: The parsed flags themselves, as vLLM hands them to each endpoint plugin's
    #: `init_state(engine_client, state, args)`; the server reads the fields above.
    args: argparse.Namespace = field(default_factory=argparse.Namespace)
