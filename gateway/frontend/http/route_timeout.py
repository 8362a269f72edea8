"""`--plugin-route-timeout SECONDS`: a plugin route that has not started its response after
that long is answered 504, so its client is freed.

It cannot stop code that blocks the event loop (nothing runs until that code returns; the
watchdog names it), nor a plain `def` handler's thread: the handler goes on in the
background and whatever it answers later is dropped. An `async` handler waiting on I/O is
cancelled. A response already started (a stream) is left alone. Core routes never time
out. Front-end process only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.frontend.http.middleware import send_error
from gateway.logger import init_logger

logger = init_logger(__name__)


class PluginRouteTimeoutMiddleware:
    """See the module docstring. `is_plugin_route(scope)` is asked after routing."""

    def __init__(self, app: ASGIApp, timeout_s: float,
                 is_plugin_route: Callable[[Scope], bool]) -> None:
        self.app = app
        self.timeout_s = timeout_s
        self.is_plugin_route = is_plugin_route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = timed_out = False

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if timed_out:
                return  # the client has its 504 already
            started = started or message["type"] == "http.response.start"
            await send(message)

        task = asyncio.ensure_future(self.app(scope, receive, guarded_send))
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
            if done or started or not self.is_plugin_route(scope):
                await task
                return
        except BaseException:
            task.cancel()
            raise
        timed_out = True
        task.cancel()  # frees an awaiting handler; a thread runs on to its end
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        logger.warning("Plugin route %s %s did not answer within %g s (--plugin-route-"
                       "timeout); answered 504.", scope.get("method"), scope.get("path"),
                       self.timeout_s)
        await send_error(send, 504, f"The route did not answer within {self.timeout_s:g} s.",
                         code="timeout")
