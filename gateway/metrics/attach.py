"""Wiring metrics into the front end's app: `attach_metrics(app, stat_loggers)`.

Front-end process, called once by `gateway serve` after `build_app`.
"""

from __future__ import annotations

from typing import Any

from gateway.metrics.manager import StatLoggerManager
from gateway.metrics.plugin_metrics import PluginLoadCollector, PluginRouteMetricsMiddleware
from gateway.plugins import load_report


def attach_metrics(app: Any, stat_loggers: StatLoggerManager, engine_client: Any) -> None:
    """Make the app's /metrics render the stat loggers' registries, plus the gateway's own.

    1. `app.state.metrics_registry` (what /metrics renders) becomes the manager's exposition
       registry, and `app.state.stat_loggers` the manager.
    2. Plugin load outcomes, read at each scrape from this process's report and
       `engine_client.plugin_reports()` (engine core and workers).
    3. The plugin-route middleware (outermost, so it sees the final status, 500 included).

    Call before the app serves its first request (Starlette freezes middleware then).
    """
    registries = stat_loggers.registries
    app.state.metrics_registry = registries.exposition
    app.state.stat_loggers = stat_loggers
    registries.exposition.register(PluginLoadCollector([lambda: load_report().to_dicts(),
                                                        engine_client.plugin_reports]))
    app.add_middleware(PluginRouteMetricsMiddleware, registries=registries)
