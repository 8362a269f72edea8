"""What `gateway serve` checks and says at start-up, before and after the engine loads.

Before: the TLS files load and the listening socket is bound, so a bad certificate or a
port in use is one line in the log within a second, not after the model has loaded.
After: a summary an operator can read at a glance: the version, the flags that differ
from their defaults, the model and its tasks, every route (core, or which plugin owns it),
and where the server listens. (The platform and dtype, with the reason for an `auto`
dtype, are logged by each worker, which is where they are decided.) Front-end process.
"""

from __future__ import annotations

import argparse
import socket
import ssl
from typing import Any

from fastapi import FastAPI

import gateway
from gateway.frontend.cli.args import add_server_args
from gateway.frontend.server_config import HttpConfig, ServerConfig
from gateway.frontend.server_state import app_state
from gateway.logger import init_logger
from gateway.plugins import EngineClient

logger = init_logger("gateway.serve")

_SECRET_ARGS = frozenset({"api_key"})
_INTERNAL_ARGS = frozenset({"command", "general_plugin_error"})


class StartupError(RuntimeError):
    """The server cannot start; the message says why in one line."""


def check_tls(http: HttpConfig) -> None:
    """Load the TLS files as uvicorn will, so a bad path or key fails now, in one line."""
    if not (http.ssl_keyfile or http.ssl_certfile or http.ssl_ca_certs):
        return
    if not (http.ssl_keyfile and http.ssl_certfile):
        raise StartupError("TLS needs both --ssl-keyfile and --ssl-certfile")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(http.ssl_certfile, http.ssl_keyfile)
        if http.ssl_ca_certs:
            context.load_verify_locations(http.ssl_ca_certs)
    except (OSError, ssl.SSLError) as exc:
        raise StartupError(f"cannot load the TLS files: {exc}") from None
    if http.ssl_cert_reqs == ssl.CERT_REQUIRED and not http.ssl_ca_certs:
        raise StartupError("--ssl-cert-reqs 2 (client certificates required) needs "
                           "--ssl-ca-certs to check them against")


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound now (uvicorn serves on it later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = "is in use" if exc.errno == 98 else f"cannot be bound ({exc.strerror})"
        raise StartupError(f"port {port} on {host} {reason}; choose another with --port"
                           ) from None
    sock.set_inheritable(True)
    return sock


def non_default_args(args: argparse.Namespace, defaults: argparse.Namespace) -> dict[str, Any]:
    """The flags whose values differ from their defaults (secrets shown as '***')."""
    changed = {}
    default_values = vars(defaults)
    for name, value in sorted(vars(args).items()):
        if name in _INTERNAL_ARGS or default_values.get(name) == value:
            continue
        changed[name] = "***" if name in _SECRET_ARGS and value else value
    return changed


def route_table(app: FastAPI) -> list[str]:
    """'METHODS PATH (owner)' for each HTTP route: `core` or the plugin that attached it."""
    owners = {id(route): plugin.entry_name for plugin in app_state(app).endpoint_plugins
              for route in plugin.routes}
    lines = []
    for route in app.router.routes:
        methods = sorted(getattr(route, "methods", None) or ())
        if not methods:
            continue
        owner = owners.get(id(route))
        lines.append(f"{','.join(methods)} {getattr(route, 'path', '')} "
                     f"({'plugin ' + owner if owner else 'core'})")
    return lines


def log_summary(config: ServerConfig, app: FastAPI, engine_client: EngineClient) -> None:
    http = config.http
    logger.info("gateway %s: serving %s as %r (tasks: %s).", gateway.__version__,
                engine_client.config.model.model or "the default model",
                engine_client.model_name, ", ".join(engine_client.supported_tasks))
    logger.info("Non-default arguments: %s",
                non_default_args(config.args, default_args()) or "none")
    logger.info("Routes: %s", "; ".join(route_table(app)))
    logger.info("Listening on %s://%s:%d%s", http.scheme, http.host, http.port,
                " (client certificates required)" if http.ssl_cert_reqs == 2 else "")


def default_args() -> argparse.Namespace:
    """Every `gateway serve` flag at its default, for the start-up summary."""
    return add_server_args(argparse.ArgumentParser()).parse_args([])
