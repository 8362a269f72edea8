"""Wiring metrics into the front end's app: `attach_metrics(app, stat_loggers)`.

Front-end process, called once by `gateway serve` after `build_app`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from prometheus_client import PLATFORM_COLLECTOR
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.metrics.http_metrics import HttpMetricsMiddleware
from gateway.metrics.manager import StatLoggerManager
from gateway.metrics.plugin_metrics import PluginLoadCollector, PluginRouteMetricsMiddleware
from gateway.metrics.process_metrics import ServerGcCollector, ServerProcessCollector
from gateway.plugins import load_report
from gateway.plugins.process import process_role


def attach_metrics(app: Any, stat_loggers: StatLoggerManager, engine_client: Any) -> None:
    """Make the app's /metrics render the stat loggers' registries, plus the gateway's own.

    1. `app.state.metrics_registry` (what /metrics renders) becomes the manager's exposition
       registry, and `app.state.stat_loggers` the manager.
    2. Plugin load outcomes, read at each scrape from this process's report, the other
       API servers' (`app.state.peer_plugin_reports`, with `--api-server-count`) and
       `engine_client.plugin_reports()` (engine core and workers).
    3. `process_*` of every server process (front ends, engine core, local workers),
       `python_gc_*` of this front end, the engine core and local workers, `python_info` of
       the front end, and `vllm:cache_config_info`.
    4. The HTTP and plugin-route middlewares (outermost, so they see the final status, 500
       included).

    Call before the app serves its first request (Starlette freezes middleware then).
    """
    registries = stat_loggers.registries
    app.state.metrics_registry = registries.exposition
    app.state.stat_loggers = stat_loggers
    exposition = registries.exposition
    peer_reports = getattr(app.state, "peer_plugin_reports", list)  # other API servers
    exposition.register(PluginLoadCollector([lambda: load_report().to_dicts(), peer_reports,
                                             engine_client.plugin_reports]))
    peer_pids = getattr(app.state, "peer_process_pids", dict)
    exposition.register(ServerProcessCollector(
        lambda: {**_server_processes(engine_client), **peer_pids()}))
    exposition.register(ServerGcCollector(lambda: _server_processes(engine_client),
                                          lambda: _gc_stats_dirs(engine_client)))
    exposition.register(PLATFORM_COLLECTOR)  # a stateless reader of this process
    exposition.register(CacheConfigCollector(stat_loggers.config, engine_client))
    app.add_middleware(PluginRouteMetricsMiddleware, registries=registries)
    app.add_middleware(HttpMetricsMiddleware, registries=registries)


def _gc_stats_dirs(engine_client: Any) -> list[str]:
    """Where the engine client's processes keep their gc counts: one folder per engine."""
    engines = getattr(engine_client, "engines", None) or [engine_client]  # data parallel
    return [folder for engine in engines
            if (folder := getattr(engine, "gc_stats_dir", None)) is not None]


def _server_processes(engine_client: Any) -> dict[str, int]:
    return {process_role(): os.getpid(), **getattr(engine_client, "process_pids", {})}


class CacheConfigCollector(Collector):
    """vLLM's `vllm:cache_config_info`: 1, with the KV-cache configuration as labels."""

    def __init__(self, config: Any, engine_client: Any) -> None:
        cache = config.cache
        self.labels = {
            "block_size": str(cache.block_size),
            "num_gpu_blocks": str(getattr(engine_client, "num_kv_blocks", 0)),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(getattr(cache, "enable_prefix_caching", False)),
            "kv_cache_memory_gib": str(cache.kv_cache_memory_gib),
            "model_name": str(config.model.served_model_name or config.model.model),
        }

    def collect(self) -> Iterator[Any]:
        info = GaugeMetricFamily("vllm:cache_config_info",
                                 "Information of the LLMEngine CacheConfig",
                                 labels=list(self.labels))
        info.add_metric(list(self.labels.values()), 1.0)
        yield info
