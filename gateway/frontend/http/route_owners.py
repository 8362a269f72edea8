"""What the raw ASGI middlewares (HTTP metrics, plugin-route metrics, tracing) read about a
request once the app has answered it: the status it answered, the route template it
matched, and the endpoint plugin that owns that route.

Front-end process. Every value is from a bounded set, whatever clients send: a route is a
matched route's path template (never the raw path), a request that matched no route is
`other`, and a method outside HTTP's standard set is `other` (`method_label`).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.frontend.endpoint_plugins import AttachedPlugin

#: HTTP methods kept as a label value; any other method a client invents is "other".
STANDARD_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS",
                              "TRACE", "PATCH"})
OTHER = "other"


def method_label(method: str) -> str:
    return method if method in STANDARD_METHODS else OTHER


class ResponseStatus:
    """An ASGI `send` that passes every message on and remembers the response's status.

    `code` is 500 until the app answers: what the client gets when the app raises first."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.code = 500

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.code = message["status"]
        await self.send(message)


#: The endpoint plugins that serve now (each with `entry_name` and `routes`).
ServingPlugins = Callable[[], Sequence[AttachedPlugin]]


class RouteOwners:
    """Which plugin owns a routed request's route, read from `plugins()` (the plugins that
    serve) after routing, so routes taken out by a failed `init_state` belong to no plugin.
    The table is rebuilt only when that list changes."""

    def __init__(self, plugins: ServingPlugins) -> None:
        self._plugins = plugins
        self._owners: dict[int, tuple[str, str]] = {}
        self._owners_of: tuple[int, int] | None = None  # (id, len) of the plugin list used

    def plugin_route(self, scope: Scope) -> tuple[str, str] | None:
        """(plugin entry name, route template) of a plugin's route; None otherwise."""
        route = scope.get("route")
        if route is None:
            return None
        plugins = self._plugins()
        key = (id(plugins), len(plugins))
        if key != self._owners_of:
            self._owners = plugin_route_owners(plugins)
            self._owners_of = key
        return self._owners.get(id(route))

    def route_and_plugin(self, scope: Scope) -> tuple[str, str]:
        """(route template, owning plugin or "") of any request; ("other", "") unrouted."""
        owner = self.plugin_route(scope)
        if owner is not None:
            return owner[1], owner[0]
        route: Any = scope.get("route")
        return (OTHER, "") if route is None else (str(getattr(route, "path", OTHER)), "")


class AnsweredRequestMiddleware(abc.ABC):
    """Raw ASGI base of the metrics middlewares: after each HTTP request (answered, or
    raised on), `answered(scope, status, seconds)` with the time to the end of the response
    body (a stream is timed to its last chunk); `self.owners` resolves its route."""

    def __init__(self, app: ASGIApp, plugins: ServingPlugins) -> None:
        self.app = app
        self.owners = RouteOwners(plugins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = ResponseStatus(send)
        try:
            await self.app(scope, receive, status)
        finally:
            self.answered(scope, status.code, time.perf_counter() - start)

    @abc.abstractmethod
    def answered(self, scope: Scope, status: int, seconds: float) -> None:
        """Record one answered request (the subclass's metrics)."""


def plugin_route_owners(plugins: Iterable[AttachedPlugin]) -> dict[int, tuple[str, str]]:
    """{id(route): (plugin entry name, path template)} for the routes each plugin added. A
    router included whole counts by the routes inside it (what routing puts in the scope)."""
    owners: dict[int, tuple[str, str]] = {}
    for plugin in plugins:
        for route in plugin.routes:
            contexts = getattr(route, "effective_route_contexts", None)
            if callable(contexts):
                for context in contexts():
                    inner = context.original_route
                    owners[id(inner)] = (plugin.entry_name,
                                         str(context.path or getattr(inner, "path", "")))
            else:
                owners[id(route)] = (plugin.entry_name, str(getattr(route, "path", "")))
    return owners
