"""HTTP metrics of every route (front end): requests and latency by route template, method
and status, with the plugin that owns the route (`plugin=""` for core routes).

- `gateway_http_requests_total{route,method,status,plugin}`
- `gateway_http_request_duration_seconds{route,method,plugin}`: from the request to the end
  of its response body (a stream is timed to its last chunk).

Labels stay bounded whatever clients send: the route is the matched route's path template
(`/v1/models`, never the raw path), and a request that matched no route (a 404, a scan)
counts under `route="other"`; a method outside HTTP's standard set counts as `other`.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.metrics.plugin_metrics import LATENCY_BUCKETS, plugin_route_owners
from gateway.metrics.registry import MetricSpec, MetricsRegistries

STANDARD_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS",
                              "TRACE", "PATCH"})
OTHER = "other"
HTTP_METRICS = (
    MetricSpec("gateway_http_requests_total", "counter",
               "HTTP requests answered, by route template, method, status and owning plugin.",
               labels=("route", "method", "status", "plugin")),
    MetricSpec("gateway_http_request_duration_seconds", "histogram",
               "Time from an HTTP request to the end of its response, by route template.",
               LATENCY_BUCKETS, labels=("route", "method", "plugin")),
)


class HttpMetricsMiddleware:
    """Raw ASGI: one wrapped `send` per request, labels resolved once per route."""

    def __init__(self, app: ASGIApp, registries: MetricsRegistries) -> None:
        self.app = app
        metrics = registries.declare(HTTP_METRICS)
        self.requests = metrics["gateway_http_requests_total"]
        self.duration = metrics["gateway_http_request_duration_seconds"]
        self._owners: dict[int, tuple[str, str]] = {}
        self._owners_of: tuple[int, int] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client gets when the app raises before it answered

        async def send_and_see(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_see)
        finally:
            route, plugin = self._labels(scope)
            method = scope["method"] if scope["method"] in STANDARD_METHODS else OTHER
            self.requests.labels(route, method, str(status), plugin).inc()
            self.duration.labels(route, method, plugin).observe(time.perf_counter() - start)

    def _labels(self, scope: Scope) -> tuple[str, str]:
        route: Any = scope.get("route")
        if route is None:
            return OTHER, ""
        plugins = getattr(getattr(scope.get("app"), "state", None), "endpoint_plugins", None)
        key = (id(plugins), len(plugins or ()))
        if key != self._owners_of:
            self._owners = plugin_route_owners(plugins or [])
            self._owners_of = key
        owner = self._owners.get(id(route))
        if owner is not None:
            return owner[1], owner[0]
        return str(getattr(route, "path", OTHER)), ""
