"""The drain on SIGTERM or SIGINT (API-server process): finish what runs, refuse what comes.

1. The server keeps listening, and every new request but the probes gets a 503
   (`shutting_down`, `Connection: close`), so a load balancer moves clients elsewhere;
   `/health` answers 503 too.
2. Requests in progress get up to `--shutdown-timeout` seconds to finish.
3. Those still running then end with `ServerShuttingDownError`: a stream gets an SSE error
   event and `data: [DONE]`, a whole response a 503; the engine aborts them.
4. Then the HTTP server closes its connections and the engine is shut down. A second
   signal cuts the wait short.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.frontend.engine_client.errors import EngineDeadError
from gateway.frontend.http.middleware import PROBE_PATHS, route_path, send_error
from gateway.logger import init_logger
from gateway.plugins import EngineClient

logger = init_logger(__name__)

_POLL_S = 0.05
_WRITE_OUT_S = 2.0  # after the streams were ended, their last events get this long to go


class ServerShuttingDownError(EngineDeadError):
    """The server ended a request because it is shutting down (after the drain time)."""


class Drain:
    """The drain's state, shared by the middleware, /health and the HTTP server."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.is_draining = False
        self.num_active = 0  # requests in progress, probes excepted

    async def run(self, engine_client: EngineClient, should_hurry: Callable[[], bool]) -> None:
        """Steps 1-3 of the module docstring; returns when nothing is left running."""
        self.is_draining = True
        started = time.monotonic()
        if self.num_active:
            logger.info("Draining: %d requests in progress get up to %.0f s to finish; new "
                        "requests get 503.", self.num_active, self.timeout_s)
        await self._wait(started + self.timeout_s, should_hurry)
        if self.num_active:
            num_ended = engine_client.fail_requests(ServerShuttingDownError(
                "the server is shutting down"))
            logger.warning("Drain time over: ended %d requests still in the engine (%d in "
                           "progress).", num_ended, self.num_active)
            await self._wait(time.monotonic() + _WRITE_OUT_S, should_hurry)
        logger.info("Drained in %.1f s.", time.monotonic() - started)

    async def _wait(self, deadline: float, should_hurry: Callable[[], bool]) -> None:
        while self.num_active and time.monotonic() < deadline and not should_hurry():
            await asyncio.sleep(_POLL_S)


class DrainMiddleware:
    """Counts the requests in progress and, while draining, answers new ones 503."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.is_draining:
            await send_error(send, 503, "The server is shutting down; retry on another "
                             "replica.", code="shutting_down",
                             headers=[(b"connection", b"close")])
            return
        self.drain.num_active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.num_active -= 1
