"""The serving loop of one API-server process: `serve(config, sock)`. `gateway serve` runs it
in its own process (cli/serve.py); with `--api-server-count N` each of the N API-server
processes runs it with its `ApiServerRole` (scaling/server_proc.py).

1. The engine client starts the engine core(s) and waits for their handshake (or, one of
   several API servers, connects to those the supervisor started).
2. `build_app` assembles the app: core routes, endpoint plugins, metrics, reliability.
3. uvicorn runs the app's lifespan (plugins' `init_state`) and serves.
4. On SIGINT or SIGTERM, uvicorn drains (http/drain.py), then the engine client shuts
   down, so no child process outlives the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Protocol

import uvicorn
from fastapi import FastAPI

from gateway.config import EngineConfig
from gateway.frontend import startup
from gateway.frontend.app import TracingUnavailableError, build_app
from gateway.frontend.engine_client.client import AsyncEngineClient, ClientOptions
from gateway.frontend.engine_client.errors import EngineStartError
from gateway.frontend.http.connections import AcceptErrorLog, http_protocol
from gateway.frontend.http.log_redaction import install_log_redaction
from gateway.frontend.http.request_logger import RequestLogger
from gateway.frontend.io_processor import make_io_processor
from gateway.frontend.memory import fix_mmap_threshold
from gateway.frontend.openai.lora import check_lora_modules
from gateway.frontend.server_config import ServerConfig
from gateway.frontend.server_state import PeerProcesses, app_state
from gateway.logger import init_logger, uvicorn_log_config
from gateway.metrics.manager import StatLoggerManager
from gateway.models.info.lora_adapter import AdapterError
from gateway.models.info.paths import ModelInfo, read_model_info
from gateway.plugins import EngineClient, PluginError

logger = init_logger("gateway.serve")

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# After the drain (--shutdown-timeout, drain.py), what is still open (a plugin route that
# never reached the engine) gets this long, then uvicorn cancels it.
_GRACEFUL_SHUTDOWN_S = 2
_ENGINE_SHUTDOWN_S = 20  # then the engine gets this long to stop (it waits for its workers)
_ENGINE_DEAD_GRACE_S = 2.0  # after the engine died, /health answers 503 this long, then exit
ENGINE_DEAD_EXIT_CODE = 1


class ServerRole(Protocol):
    """What makes one of several API servers differ from a lone server (the role is
    scaling/server_proc.py's `ApiServerRole`)."""

    @property
    def runs_stat_loggers(self) -> bool:
        """Whether this API server gets the engine's stats (API server 0)."""
        ...

    async def connect_engine(self, config: EngineConfig, model_info: ModelInfo,
                             options: ClientOptions) -> AsyncEngineClient:
        """The engine client of the engine core(s) the supervisor started."""
        ...

    def peers(self) -> PeerProcesses:
        """The other processes' load reports and pids, and where this one publishes its."""
        ...

    def keep_report_published(self) -> asyncio.Task[None]:
        """Republish this process's load report when it changes (in the running loop)."""
        ...


async def serve(config: ServerConfig, sock: socket.socket | None = None,
                role: ServerRole | None = None) -> int:
    """The server's life (see the module doc); the process exit code. `role`: this process's
    part when it is one of several API servers.

    A signal that arrives during start-up cancels it and shuts the engine down as a drain
    does. If the engine core dies while serving (killed, out of memory, a crash), the server
    does not go on with a dead engine: the engine client fails every in-flight request at
    once (503, or an SSE error event on a stream that had started), /health and /ping answer
    503 for `_ENGINE_DEAD_GRACE_S` (so a load balancer sees the failure and clients get a
    proper error, not a refused connection), then the server stops as on SIGTERM and exits
    with code 1, for the supervisor (systemd, Kubernetes, compose) to restart it.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    _on_stop_signals(loop, task.cancel)
    fix_mmap_threshold()  # large request bodies leave nothing resident once freed
    AcceptErrorLog().install(loop)
    engine_client: EngineClient | None = None
    stat_loggers: StatLoggerManager | None = None
    app: FastAPI | None = None
    publishing: asyncio.Task[None] | None = None  # this API server's report, kept published
    try:
        model_info = read_model_info(config.engine.model.model)  # torch-free, read once here
        io_processor = make_io_processor(config.engine, model_info)  # rule 8, before the engine
        check_lora_modules(config.engine.lora, model_info, config.openai.lora_modules)
        engine_client = await _start_engine_client(config, model_info, role)
        stat_loggers = StatLoggerManager(
            config.engine, engine_client.model_name, engine_client,
            enable_logging=not config.observability.disable_log_stats,
            engine_stats=role is None or role.runs_stat_loggers)
        app = build_app(config, engine_client, stat_loggers=stat_loggers,
                        io_processor=io_processor,
                        peers=role.peers() if role is not None else None)
        if role is not None:
            publishing = role.keep_report_published()
        return await _run(config, app, engine_client, stat_loggers, sock)
    except asyncio.CancelledError:
        logger.info("Stopped during start-up.")
        return 0
    except (PluginError, EngineStartError, FileNotFoundError, TracingUnavailableError,
            AdapterError) as exc:
        logger.error("Cannot start: %s", exc)
        return 1
    finally:
        _on_stop_signals(loop, lambda: logger.warning("Already shutting down."))
        if publishing is not None:
            publishing.cancel()
        if stat_loggers is not None:
            await stat_loggers.shutdown()
        tracer_provider = app_state(app).tracer_provider if app is not None else None
        if tracer_provider is not None:
            await asyncio.to_thread(tracer_provider.shutdown)  # sends the last spans
        if engine_client is not None:
            await _shut_down(engine_client)
        _restore_signals(loop)


async def _start_engine_client(config: ServerConfig, model_info: ModelInfo,
                               role: ServerRole | None) -> EngineClient:
    options = client_options(config)
    if role is not None:
        return await role.connect_engine(config.engine, model_info, options)
    return await AsyncEngineClient.start(config.engine, model_info=model_info, options=options)


def client_options(config: ServerConfig) -> ClientOptions:
    """What the server's flags set on its engine client."""
    observability = config.observability
    request_logger = (RequestLogger(observability.max_log_len, observability.enable_log_outputs)
                      if observability.enable_log_requests else None)
    return ClientOptions(max_num_queued_reqs=config.reliability.max_num_queued_reqs,
                         stall_threshold_s=config.reliability.engine_stall_threshold_s,
                         request_logger=request_logger)


async def _run(config: ServerConfig, app: FastAPI, engine_client: EngineClient,
               stat_loggers: StatLoggerManager, sock: socket.socket | None) -> int:
    """Serve `app` until stopped; the exit code."""
    loop = asyncio.get_running_loop()
    reliability = app_state(app).reliability
    assert reliability is not None  # build_app attached it
    stat_loggers.start()
    _restore_signals(loop)
    server = _Server(_uvicorn_config(app, config))  # configures uvicorn's logging
    server.drain = lambda: reliability.drain.run(engine_client, lambda: server.force_exit)
    reliability.start(loop)
    install_log_redaction([config.http.api_key or ""])
    engine_client.add_death_listener(lambda: _stop_after_grace(loop, server))
    startup.log_summary(config, app, engine_client)
    await server.serve(sockets=[sock] if sock is not None else None)
    if engine_client.is_dead and engine_client.dead_reason != "shut down":
        logger.error("Exiting because the engine died (%s).", engine_client.dead_reason)
        return ENGINE_DEAD_EXIT_CODE
    return 0


def _stop_after_grace(loop: asyncio.AbstractEventLoop, server: uvicorn.Server) -> None:
    logger.error("The engine is dead; the server stops in %.0f s.", _ENGINE_DEAD_GRACE_S)
    loop.call_later(_ENGINE_DEAD_GRACE_S, setattr, server, "should_exit", True)


async def _shut_down(engine_client: EngineClient) -> None:
    logger.info("Shutting down the engine.")
    try:
        await asyncio.wait_for(engine_client.shutdown(), _ENGINE_SHUTDOWN_S)
    except TimeoutError:
        # The engine core also exits by itself once it sees its parent gone.
        logger.error("The engine did not shut down within %d s; exiting anyway.",
                     _ENGINE_SHUTDOWN_S)


def _uvicorn_config(app: FastAPI, config: ServerConfig) -> uvicorn.Config:
    http = config.http
    return uvicorn.Config(
        app, host=http.host, port=http.port, root_path=http.root_path,
        log_level=http.uvicorn_log_level,
        log_config=uvicorn_log_config(config.observability.log_format),
        access_log=http.access_log, lifespan="on", timeout_keep_alive=http.timeout_keep_alive_s,
        http=http_protocol(http.header_timeout_s),
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
        ssl_keyfile=http.ssl_keyfile, ssl_certfile=http.ssl_certfile,
        ssl_ca_certs=http.ssl_ca_certs, ssl_cert_reqs=http.ssl_cert_reqs)


class _Server(uvicorn.Server):
    """uvicorn's server, except that after a graceful stop it does not re-raise the
    SIGINT/SIGTERM it caught: the engine still has to be shut down; and that it drains
    (`drain`, while still listening) before it closes its sockets."""

    drain: Callable[[], Awaitable[None]] | None = None

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.drain is not None:
            await self.drain()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            captured = getattr(self, "_captured_signals", [])
            if captured:
                logger.info("Received %s; stopping.", signal.Signals(captured[-1]).name)
                captured.clear()


def _on_stop_signals(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, callback)


def _restore_signals(loop: asyncio.AbstractEventLoop) -> None:
    for sig in _STOP_SIGNALS:
        loop.remove_signal_handler(sig)
