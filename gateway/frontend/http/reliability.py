"""Wiring the reliability pieces into `gateway serve`: `attach_reliability(app, ...)`.

- the event-loop watchdog (loop_watchdog.py) and its WARNING and metrics;
- the engine's liveness threshold (engine/liveness.py) and `gateway_engine_stalled`;
- load shedding (engine/admission.py) and `gateway_requests_rejected_total{reason}`;
- the drain on SIGTERM (drain.py);
- `--plugin-route-timeout` (route_timeout.py).

User-facing behaviour: docs/reliability.md. Front-end process only.
"""

from __future__ import annotations

import argparse
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
from gateway.frontend.http.route_owners import plugin_route_owners
from gateway.frontend.http.route_timeout import PluginRouteTimeoutMiddleware
from gateway.logger import init_logger
from gateway.metrics.registry import MetricSpec, MetricsRegistries

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


def attach_reliability(app: Any, engine_client: Any, args: argparse.Namespace,
                       registries: MetricsRegistries) -> Reliability:
    """Apply the reliability flags to `engine_client` and `app` (middleware, metrics,
    `app.state.drain`). Call before the app serves (Starlette freezes middleware then)."""
    metrics = registries.declare(METRICS)
    engine_client.liveness.stall_threshold_s = args.engine_stall_threshold
    engine_client.admission.max_num_queued_reqs = args.max_num_queued_reqs
    rejected = metrics["gateway_requests_rejected_total"]
    engine_client.admission.rejection_listeners.append(lambda reason: rejected.labels(reason).inc())
    registries.exposition.register(EngineStalledCollector(engine_client))
    drain = Drain(args.shutdown_timeout)
    app.state.drain = drain
    timeout_s = getattr(args, "plugin_route_timeout", None)
    if timeout_s:  # innermost of the three: its task is tied to the request too
        app.add_middleware(PluginRouteTimeoutMiddleware, timeout_s=timeout_s,
                           is_plugin_route=lambda scope: _plugin_of(app, scope) is not None)
    tracker = RequestTracker()
    app.add_middleware(TrackRequestsMiddleware, tracker=tracker)
    app.add_middleware(DrainMiddleware, drain=drain)
    watchdog = LoopWatchdog(args.event_loop_stall_threshold, tracker,
                            lambda stall: _on_stall(app, metrics, stall))
    return Reliability(drain, watchdog, tracker)


def _on_stall(app: Any, metrics: dict[str, Any], stall: Stall) -> None:
    metrics["gateway_event_loop_stall_seconds"].observe(stall.duration_s)
    at = f" at {stall.location}" if stall.location else ""
    if stall.scope is None:
        logger.warning("The event loop was blocked for %.2f s, outside any request%s; every "
                       "request waited.", stall.duration_s, at)
        return
    route = stall.scope.get("route")
    owner = _plugin_of(app, stall.scope)
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


def _plugin_of(app: Any, scope: Any) -> tuple[str, str] | None:
    """(plugin, path template) of the plugin route a routed request went to, else None."""
    owners = plugin_route_owners(getattr(app.state, "endpoint_plugins", []))
    return owners.get(id(scope.get("route")))


class EngineStalledCollector(Collector):
    """`gateway_engine_stalled`: 1 while the engine makes no progress with requests
    pending (see engine/liveness.py), else 0; read at each scrape."""

    def __init__(self, engine_client: Any) -> None:
        self.engine_client = engine_client

    def collect(self) -> Iterator[Any]:
        gauge = GaugeMetricFamily("gateway_engine_stalled", "1 while requests are pending "
                                  "and no engine step completed for --engine-stall-threshold.")
        gauge.add_metric([], float(self.engine_client.liveness.is_stalled))
        yield gauge
