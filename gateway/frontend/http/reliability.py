"""Wiring the reliability pieces into the app: `attach_reliability(app, ...)`, called by
`build_app` after the metrics.

- the event-loop watchdog (loop_watchdog.py) and its WARNING and metrics;
- the engine's liveness (engine_client/liveness.py) as `gateway_engine_stalled`;
- load shedding (engine_client/admission.py) as `gateway_requests_rejected_total{reason}`;
- the drain on SIGTERM (drain.py);
- `--plugin-route-timeout` (route_timeout.py).

User-facing behaviour: docs/reliability.md. Front-end process only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.frontend.http.drain import Drain, DrainMiddleware
from gateway.frontend.http.loop_watchdog import (
    LoopWatchdog,
    RequestTracker,
    Stall,
    TrackRequestsMiddleware,
)
from gateway.frontend.http.route_owners import ServingPlugins, plugin_route_owners
from gateway.frontend.http.route_timeout import PluginRouteTimeoutMiddleware
from gateway.frontend.server_config import ReliabilityConfig
from gateway.logger import init_logger
from gateway.metrics.registry import MetricSpec, MetricsRegistries
from gateway.plugins import EngineClient

logger = init_logger("gateway.reliability")

STALL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
METRICS = (
    MetricSpec("gateway_event_loop_stall_seconds", "histogram",
               "Stalls of the front end's event loop longer than "
               "--event-loop-stall-threshold: how long every other request waited.",
               STALL_BUCKETS),
    MetricSpec("gateway_plugin_route_stalls_total", "counter",
               "Event-loop stalls caused by an endpoint-plugin route.",
               labels=("plugin", "route")),
    MetricSpec("gateway_requests_rejected_total", "counter",
               "Requests refused with 503 for load: queue_full (--max-num-queued-reqs) "
               "or queue_timeout (--max-queue-time).", labels=("reason",)),
)


@dataclass
class Reliability:
    drain: Drain
    watchdog: LoopWatchdog
    tracker: RequestTracker

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """In the serving loop, before the first request."""
        self.tracker.install(loop)
        self.watchdog.start(loop)

    def stop(self) -> None:
        self.watchdog.stop()


def attach_reliability(app: Any, engine_client: EngineClient, config: ReliabilityConfig,
                       registries: MetricsRegistries, plugins: ServingPlugins) -> Reliability:
    """Add the reliability middleware and metrics to `app` (the engine client was started
    with the flags' stall threshold and queue cap). Call before the app serves (Starlette
    freezes middleware then)."""
    metrics = registries.declare(METRICS)
    rejected = metrics["gateway_requests_rejected_total"]
    engine_client.add_rejection_listener(lambda reason: rejected.labels(reason).inc())
    registries.exposition.register(EngineStalledCollector(engine_client))
    drain = Drain(config.shutdown_timeout_s)
    timeout_s = config.plugin_route_timeout_s
    if timeout_s:  # innermost of the three: its task is tied to the request too
        app.add_middleware(PluginRouteTimeoutMiddleware, timeout_s=timeout_s,
                           is_plugin_route=lambda scope: _plugin_of(plugins, scope) is not None)
    tracker = RequestTracker()
    app.add_middleware(TrackRequestsMiddleware, tracker=tracker)
    app.add_middleware(DrainMiddleware, drain=drain)
    watchdog = LoopWatchdog(config.event_loop_stall_threshold_s, tracker,
                            lambda stall: _on_stall(plugins, metrics, stall))
    return Reliability(drain, watchdog, tracker)


def _on_stall(plugins: ServingPlugins, metrics: dict[str, Any], stall: Stall) -> None:
    metrics["gateway_event_loop_stall_seconds"].observe(stall.duration_s)
    at = f" at {stall.location}" if stall.location else ""
    if stall.scope is None:
        logger.warning("The event loop was blocked for %.2f s, outside any request%s; every "
                       "request waited.", stall.duration_s, at)
        return
    route = stall.scope.get("route")
    owner = _plugin_of(plugins, stall.scope)
    path = owner[1] if owner else str(getattr(route, "path", stall.scope.get("path")))
    method = stall.scope.get("method", "")
    if owner is not None:
        metrics["gateway_plugin_route_stalls_total"].labels(*owner).inc()
        who = f"plugin {owner[0]!r} route {method} {path}"
    else:
        who = f"route {method} {path}"
    logger.warning("The event loop was blocked for %.2f s by %s (request id %s)%s; every "
                   "other request waited. Run blocking work in a plain `def` route or "
                   "with run_in_threadpool.", stall.duration_s, who, stall.request_id, at)


def _plugin_of(plugins: ServingPlugins, scope: Any) -> tuple[str, str] | None:
    """(plugin, path template) of the plugin route a routed request went to, else None."""
    owners = plugin_route_owners(plugins())
    return owners.get(id(scope.get("route")))


class EngineStalledCollector(Collector):
    """`gateway_engine_stalled`: 1 while the engine makes no progress with requests
    pending (see engine_client/liveness.py), else 0; read at each scrape."""

    def __init__(self, engine_client: EngineClient) -> None:
        self.engine_client = engine_client

    def collect(self) -> Iterator[Any]:
        gauge = GaugeMetricFamily("gateway_engine_stalled", "1 while requests are pending "
                                  "and no engine step completed for --engine-stall-threshold.")
        gauge.add_metric([], float(self.engine_client.stalled_reason is not None))
        yield gauge
