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

from starlette.types import ASGIApp, Scope

from gateway.frontend.http.route_owners import (
    AnsweredRequestMiddleware,
    ServingPlugins,
    method_label,
)
from gateway.metrics.plugin_metrics import LATENCY_BUCKETS
from gateway.metrics.registry import MetricSpec, MetricsRegistries

HTTP_METRICS = (
    MetricSpec("gateway_http_requests_total", "counter",
               "HTTP requests answered, by route template, method, status and owning plugin.",
               labels=("route", "method", "status", "plugin")),
    MetricSpec("gateway_http_request_duration_seconds", "histogram",
               "Time from an HTTP request to the end of its response, by route template.",
               LATENCY_BUCKETS, labels=("route", "method", "plugin")),
)


class HttpMetricsMiddleware(AnsweredRequestMiddleware):
    """Raw ASGI: one wrapped `send` per request, labels resolved once per route."""

    def __init__(self, app: ASGIApp, registries: MetricsRegistries,
                 plugins: ServingPlugins) -> None:
        super().__init__(app, plugins)
        metrics = registries.declare(HTTP_METRICS)
        self.requests = metrics["gateway_http_requests_total"]
        self.duration = metrics["gateway_http_request_duration_seconds"]

    def answered(self, scope: Scope, status: int, seconds: float) -> None:
        route, plugin = self.owners.route_and_plugin(scope)
        method = method_label(scope["method"])
        self.requests.labels(route, method, str(status), plugin).inc()
        self.duration.labels(route, method, plugin).observe(seconds)
