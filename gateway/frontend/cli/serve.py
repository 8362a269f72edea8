"""`gateway serve [MODEL]`: serve a model over the OpenAI-compatible HTTP API.

Front-end process. `run(args)` reads the flags into one `ServerConfig`, checks what can fail
at once (the model's files, the TLS files, the port) before anything slow starts, then
becomes what the flags ask for: the serving loop (gateway.frontend.server), the supervisor
of several API servers (`--api-server-count N`, gateway.frontend.scaling.supervisor), or
this node's worker ranks only (`--headless`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
from typing import Any

import msgspec

from gateway import envs
from gateway.frontend import startup
from gateway.frontend.cli.args import add_server_args, server_config_from_args
from gateway.frontend.http.connections import raise_fd_limit
from gateway.frontend.scaling.supervisor import run_api_servers
from gateway.frontend.server import serve
from gateway.frontend.server_config import ServerConfig
from gateway.logger import init_logger, set_log_format
from gateway.models.info.paths import fetch_draft_model, fetch_model_config
from gateway.platforms.cpu_isa import parse_cap
from gateway.plugins import allowlist_warnings

logger = init_logger("gateway.serve")


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
        config = server_config_from_args(args)
        parse_cap(envs.cpu_isa_cap())  # a bad GATEWAY_CPU_ISA: one line now, not in a worker
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    try:  # a Hugging Face repo id: its local copy (downloaded now, if the cache lacks it)
        config = _with_local_model(config)
    except FileNotFoundError as exc:
        logger.error("Cannot start: %s", exc)
        return 1
    allowlist_warnings()
    raise_fd_limit()  # every client connection is a file descriptor
    if config.headless:  # this node's worker ranks only (multi-node tensor parallelism)
        from gateway.engine.headless import run_headless
        return run_headless(config.engine)
    if config.api_server_count > 1:  # a supervisor of N API-server processes, no HTTP itself
        return run_api_servers(config)
    try:  # a bad certificate or a port in use: one line now, not after the model loads
        startup.check_tls(config.http)
        sock = startup.bind_socket(config.http.host, config.http.port)
    except startup.StartupError as exc:
        logger.error("Cannot start: %s", exc)
        return 1
    with sock:
        return asyncio.run(serve(config, sock))


def _with_local_model(config: ServerConfig) -> ServerConfig:
    engine = config.engine
    local = msgspec.structs.replace(engine, model=fetch_model_config(engine.model),
                                   speculative=fetch_draft_model(engine.speculative,
                                                                 engine.model))
    return dataclasses.replace(config, engine=local)
