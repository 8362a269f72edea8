"""The gateway's own metrics about plugins (plain names, no `vllm:`; API-server process).

`gateway_plugin_info{group,plugin,distribution,process,outcome}` (1 per entry point per
process, its current outcome) and `gateway_plugin_load_failures_total{group,plugin,
process,outcome}` are read at scrape time from the merged load reports
(`PluginLoadCollector`), so a plugin that failed only in a worker shows at the front end.
`gateway_plugin_route_requests_total{plugin,route,method,status}` and
`gateway_plugin_route_latency_seconds{plugin,route,method}` count and time each request a
plugin route answered, to the end of its body (`PluginRouteMetricsMiddleware`).
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Scope

from gateway.frontend.http.route_owners import (
    AnsweredRequestMiddleware,
    ServingPlugins,
    method_label,
)
from gateway.metrics.registry import MetricSpec, MetricsRegistries
from gateway.plugins.loader import ENDPOINT_PLUGINS_GROUP
from gateway.plugins.process import load_report
from gateway.plugins.records import FAILED_OUTCOMES

ReportSource = Callable[[], Iterable[dict[str, Any]]]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, 300.0)
ROUTE_METRICS = (
    MetricSpec("gateway_plugin_route_requests_total", "counter",
               "Requests answered by endpoint-plugin routes.",
               labels=("plugin", "route", "method", "status")),
    MetricSpec("gateway_plugin_route_latency_seconds", "histogram",
               "Time from request to the end of the response of endpoint-plugin routes.",
               LATENCY_BUCKETS, labels=("plugin", "route", "method")),
)


class PluginLoadCollector(Collector):
    """Renders the merged load reports at each scrape (register it on the exposition
    registry: its values are the front end's, never summed over processes)."""

    def __init__(self, sources: Iterable[ReportSource]) -> None:
        self.sources = list(sources)

    def collect(self) -> Iterator[Any]:
        records = [r for source in self.sources for r in source()]
        info = GaugeMetricFamily(
            "gateway_plugin_info", "Plugin entry points per process, with their load outcome.",
            labels=["group", "plugin", "distribution", "process", "outcome"])
        for labels, count in Tally(_info_labels(r) for r in records).items():
            info.add_metric(labels, count)
        failures = CounterMetricFamily(
            "gateway_plugin_load_failures", "Plugin entry points that failed to load or run "
            "their set-up, by group, plugin, process and outcome.",
            labels=["group", "plugin", "process", "outcome"])
        failed = [r for r in records if r["outcome"] in FAILED_OUTCOMES]
        for labels, count in Tally(_failure_labels(r) for r in failed).items():
            failures.add_metric(labels, count)
        yield info
        yield failures


def _info_labels(r: dict[str, Any]) -> tuple[str, ...]:
    return (r["group"], r["name"], r["distribution"], r["process_role"], r["outcome"])


def _failure_labels(r: dict[str, Any]) -> tuple[str, ...]:
    return (r["group"], r["name"], r["process_role"], r["outcome"])


class PluginRouteMetricsMiddleware(AnsweredRequestMiddleware):
    """Counts and times requests answered by endpoint-plugin routes (raw ASGI).

    Which routes are a plugin's is read from `plugins()` (the plugins that serve) after
    routing, so routes taken out by a failed `init_state` are not counted. Other requests
    pass with one wrapped `send`. Every label value comes from a bounded set, whatever
    clients send: a method outside HTTP's standard ones is "other", and a route is a
    plugin's path template (never the request's path).
    """

    def __init__(self, app: ASGIApp, registries: MetricsRegistries,
                 plugins: ServingPlugins) -> None:
        super().__init__(app, plugins)
        metrics = registries.declare(ROUTE_METRICS)
        self.requests = metrics["gateway_plugin_route_requests_total"]
        self.latency = metrics["gateway_plugin_route_latency_seconds"]

    def answered(self, scope: Scope, status: int, seconds: float) -> None:
        owner = self.owners.plugin_route(scope)
        if owner is None:
            return
        plugin, route = owner
        method = method_label(scope["method"])
        self.requests.labels(plugin, route, method, str(status)).inc()
        if status >= 500:  # in /v1/plugins too, beside the plugin's load outcome
            load_report().note_runtime_error(ENDPOINT_PLUGINS_GROUP, plugin,
                                             f"{method} {route} answered {status}")
        self.latency.labels(plugin, route, method).observe(seconds)
