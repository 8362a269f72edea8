"""`gateway serve [MODEL]`: start the engine, build the app, serve it with uvicorn.

Steps: (1) the engine client starts the engine-core process and waits for its handshake;
(2) `build_app` attaches the core routes and the endpoint plugins; (3) uvicorn runs the
app's lifespan (plugins' `init_state`) and serves; (4) on SIGINT or SIGTERM, uvicorn
drains (drain.py: --shutdown-timeout), then the engine is shut down, so no child process
outlives the server. A signal
that arrives during start-up cancels it and shuts the engine down the same way.

If the engine core dies while serving (killed, out of memory, a crash), the server does not
go on with a dead engine: the engine client fails every in-flight request at once (503, or
an SSE error event on a stream that had started), /health and /ping answer 503 for
`_ENGINE_DEAD_GRACE_S` (so a load balancer sees the failure and clients get a proper
error, not a refused connection), then the server stops as on SIGTERM and exits with code
1, for the supervisor (systemd, Kubernetes, compose) to restart it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import uvicorn

from gateway import envs
from gateway.frontend import startup
from gateway.frontend.app import build_app
from gateway.frontend.cli.args import add_server_args, engine_config_from_args
from gateway.frontend.engine_client.client import EngineStartError
from gateway.frontend.engine_client.dp_client import AnyEngineClient, start_engine_client
from gateway.frontend.http.connections import AcceptErrorLog, http_protocol, raise_fd_limit
from gateway.frontend.http.log_redaction import install_log_redaction
from gateway.frontend.http.reliability import attach_reliability
from gateway.frontend.http.request_logger import RequestLogger
from gateway.frontend.io_processor import make_io_processor
from gateway.logger import init_logger, set_log_format, uvicorn_log_config
from gateway.metrics import StatLoggerManager, attach_metrics
from gateway.models.info.paths import fetch_model_config, read_model_info
from gateway.platforms.cpu_isa import parse_cap
from gateway.plugins import PluginError, allowlist_warnings

logger = init_logger("gateway.serve")

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# After the drain (--shutdown-timeout, drain.py), what is still open (a plugin route that
# never reached the engine) gets this long, then uvicorn cancels it.
_GRACEFUL_SHUTDOWN_S = 2
_ENGINE_SHUTDOWN_S = 20  # then the engine gets this long to stop (it waits for its workers)
_ENGINE_DEAD_GRACE_S = 2.0  # after the engine died, /health answers 503 this long, then exit
ENGINE_DEAD_EXIT_CODE = 1


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model over the OpenAI-compatible HTTP API",
        description=__doc__.splitlines()[0] if __doc__ else None)
    add_server_args(parser)


def run(args: argparse.Namespace) -> int:
    """Serve until stopped; returns the process exit code."""
    os.environ["GATEWAY_LOG_FORMAT"] = args.log_format  # for the processes it starts
    set_log_format(args.log_format)
    try:
        config = engine_config_from_args(args)
        parse_cap(envs.cpu_isa_cap())  # a bad GATEWAY_CPU_ISA: one line now, not in a worker
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    try:  # a Hugging Face repo id: its local copy (downloaded now, if the cache lacks it)
        config.model = fetch_model_config(config.model)
    except FileNotFoundError as exc:
        logger.error("Cannot start: %s", exc)
        return 1
    allowlist_warnings()
    raise_fd_limit()  # every client connection is a file descriptor
    if args.headless:  # this node's worker ranks only (multi-node tensor parallelism)
        from gateway.engine.headless import run_headless
        return run_headless(config)
    if args.api_server_count > 1:  # a supervisor of N API-server processes, no HTTP itself
        from gateway.frontend.scaling.supervisor import run_api_servers
        return run_api_servers(args, config)
    try:  # a bad certificate or a port in use: one line now, not after the model loads
        startup.check_tls(args)
        sock = startup.bind_socket(args.host, args.port)
    except startup.StartupError as exc:
        logger.error("Cannot start: %s", exc)
        return 1
    with sock:
        return asyncio.run(serve(args, config, sock))


async def serve(args: argparse.Namespace, config: Any,
                sock: socket.socket | None = None, front_end: Any = None) -> int:
    """The server's life: engine up, app built, uvicorn serving, engine down.

    `front_end`: this process's `ApiServerRole` when it is one of several API servers
    (gateway.frontend.scaling.server_proc): its engine client connects to the engine core
    the supervisor started, and it runs the stat loggers only if the role says so."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    _on_stop_signals(loop, task.cancel)
    AcceptErrorLog().install(loop)
    engine_client: AnyEngineClient | None = None
    stat_loggers: StatLoggerManager | None = None
    tracer_provider: Any = None
    try:
        model_info = read_model_info(config.model.model)  # torch-free, read once here
        io_processor = make_io_processor(config, model_info)  # rule 8, before the engine
        engine_client = await (start_engine_client(config, model_info=model_info)
                               if front_end is None
                               else front_end.connect_engine(config, model_info))
        if args.enable_log_requests:
            engine_client.request_logger = RequestLogger(args.max_log_len,
                                                         args.enable_log_outputs)
        stat_loggers = StatLoggerManager(
            config, engine_client.model_name, engine_client,
            enable_logging=not args.disable_log_stats,
            engine_stats=front_end is None or front_end.runs_stat_loggers)
        app = build_app(args, engine_client, io_processor=io_processor,
                        metrics_registry=stat_loggers.registries.exposition)
        if front_end is not None:
            front_end.attach(app)  # /v1/plugins and metrics see the other processes
        attach_metrics(app, stat_loggers, engine_client)
        reliability = attach_reliability(app, engine_client, args, stat_loggers.registries)
        if args.otlp_traces_endpoint:
            tracer_provider = _attach_tracing(app, engine_client, args.otlp_traces_endpoint)
        stat_loggers.start()
        _restore_signals(loop)
        server = _Server(_uvicorn_config(app, args))  # configures uvicorn's logging
        server.drain = lambda: reliability.drain.run(engine_client, lambda: server.force_exit)
        reliability.start(loop)
        install_log_redaction([args.api_key or envs.api_key() or ""])
        engine_client.add_death_listener(lambda: _stop_after_grace(loop, server))
        startup.log_summary(args, _default_args(), app, engine_client)
        await server.serve(sockets=[sock] if sock is not None else None)
        if engine_client.is_dead and engine_client.dead_reason != "shut down":
            logger.error("Exiting because the engine died (%s).", engine_client.dead_reason)
            return ENGINE_DEAD_EXIT_CODE
        return 0
    except asyncio.CancelledError:
        logger.info("Stopped during start-up.")
        return 0
    except (PluginError, EngineStartError, FileNotFoundError, TracingUnavailableError) as exc:
        logger.error("Cannot start: %s", exc)
        return 1
    finally:
        _on_stop_signals(loop, lambda: logger.warning("Already shutting down."))
        if stat_loggers is not None:
            await stat_loggers.shutdown()
        if tracer_provider is not None:
            await asyncio.to_thread(tracer_provider.shutdown)  # sends the last spans
        if engine_client is not None:
            await _shut_down(engine_client)
        _restore_signals(loop)


def _attach_tracing(app: Any, engine_client: AnyEngineClient, endpoint: str) -> Any:
    try:
        from gateway.frontend.http.tracing import attach_tracing
    except ImportError as exc:
        raise TracingUnavailableError(
            f"--otlp-traces-endpoint needs the OpenTelemetry SDK ({exc.name} is missing): "
            "pip install 'gateway[tracing]'") from None
    return attach_tracing(app, engine_client, endpoint)


class TracingUnavailableError(RuntimeError):
    pass


def _stop_after_grace(loop: asyncio.AbstractEventLoop, server: uvicorn.Server) -> None:
    logger.error("The engine is dead; the server stops in %.0f s.", _ENGINE_DEAD_GRACE_S)
    loop.call_later(_ENGINE_DEAD_GRACE_S, setattr, server, "should_exit", True)


async def _shut_down(engine_client: AnyEngineClient) -> None:
    logger.info("Shutting down the engine.")
    try:
        await asyncio.wait_for(engine_client.shutdown(), _ENGINE_SHUTDOWN_S)
    except TimeoutError:
        # The engine core also exits by itself once it sees its parent gone.
        logger.error("The engine did not shut down within %d s; exiting anyway.",
                     _ENGINE_SHUTDOWN_S)


def _uvicorn_config(app: Any, args: argparse.Namespace) -> uvicorn.Config:
    return uvicorn.Config(
        app, host=args.host, port=args.port, root_path=args.root_path,
        log_level=args.uvicorn_log_level, log_config=uvicorn_log_config(args.log_format),
        access_log=not args.disable_uvicorn_access_log, lifespan="on",
        timeout_keep_alive=args.timeout_keep_alive,
        http=http_protocol(args.header_timeout),
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)


def _default_args() -> argparse.Namespace:
    """Every `gateway serve` flag at its default, for the start-up summary."""
    return add_server_args(argparse.ArgumentParser()).parse_args([])


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


def _on_stop_signals(loop: asyncio.AbstractEventLoop, callback: Any) -> None:
    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, callback)


def _restore_signals(loop: asyncio.AbstractEventLoop) -> None:
    for sig in _STOP_SIGNALS:
        loop.remove_signal_handler(sig)
