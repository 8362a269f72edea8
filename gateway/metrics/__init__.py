"""Metrics of the front end: the stat loggers (built-in logging and Prometheus, and the
`vllm.stat_logger_plugins`), their manager, the app's registries and the gateway's own
plugin metrics (wired into the app by `gateway.metrics.attach`, which `build_app` calls).
Engine-side stats are measured in `gateway.engine.stats`."""

from gateway.metrics.loggers import LoggingStatLogger
from gateway.metrics.manager import StatLoggerManager, StatLoggerPluginError
from gateway.metrics.plugin_metrics import PluginLoadCollector, PluginRouteMetricsMiddleware
from gateway.metrics.prometheus import PrometheusStatLogger
from gateway.metrics.registry import MetricSpec, MetricsRegistries, make_registries

__all__ = ["LoggingStatLogger", "MetricSpec", "MetricsRegistries", "PluginLoadCollector",
           "PluginRouteMetricsMiddleware", "PrometheusStatLogger", "StatLoggerManager",
           "StatLoggerPluginError", "make_registries"]
