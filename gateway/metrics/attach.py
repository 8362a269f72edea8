"""Wiring metrics into the front end's app: `attach_metrics(app, state, stat_loggers)`.

Front-end process, called once by `build_app`, after the endpoint plugins.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from prometheus_client import PLATFORM_COLLECTOR
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.config import EngineConfig
from gateway.frontend.server_state import ServerState
from gateway.metrics.http_metrics import HttpMetricsMiddleware
from gateway.metrics.manager import StatLoggerManager
from gateway.metrics.plugin_metrics import PluginLoadCollector, PluginRouteMetricsMiddleware
from gateway.metrics.process_metrics import ServerGcCollector, ServerProcessCollector
from gateway.plugins import EngineClient, load_report
from gateway.plugins.process import process_role


def attach_metrics(app: FastAPI, state: ServerState, stat_loggers: StatLoggerManager) -> None:
    """Make the app's /metrics render the stat loggers' registries, plus the gateway's own.

    1. `state.metrics_registry` (what /metrics renders) becomes the manager's exposition
       registry.
    2. Plugin load outcomes, read at each scrape from this process's report, the other
       API servers' (`state.peers`, with `--api-server-count`) and
       `engine_client.plugin_reports()` (engine core and workers).
    3. `process_*` of every server process (front ends, engine core, local workers),
       `python_gc_*` of this front end, the engine core and local workers, `python_info` of
       the front end, and `vllm:cache_config_info`.
    4. The HTTP and plugin-route middlewares (outermost, so they see the final status, 500
       included).

    Call before the app serves its first request (Starlette freezes middleware then).
    """
    registries = stat_loggers.registries
    engine_client = state.engine_client
    state.metrics_registry = exposition = registries.exposition
    exposition.register(PluginLoadCollector([lambda: load_report().to_dicts(),
                                             state.peer_records, engine_client.plugin_reports]))
    exposition.register(ServerProcessCollector(
        lambda: {**_server_processes(engine_client), **state.peer_pids()}))
    exposition.register(ServerGcCollector(lambda: _server_processes(engine_client),
                                          lambda: engine_client.gc_stats_dirs))
    exposition.register(PLATFORM_COLLECTOR)  # a stateless reader of this process
    exposition.register(CacheConfigCollector(stat_loggers.config, engine_client))
    serving_plugins = lambda: state.endpoint_plugins  # noqa: E731 - read at each request
    app.add_middleware(PluginRouteMetricsMiddleware, registries=registries,
                       plugins=serving_plugins)
    app.add_middleware(HttpMetricsMiddleware, registries=registries, plugins=serving_plugins)


def _server_processes(engine_client: EngineClient) -> dict[str, int]:
    return {process_role(): os.getpid(), **engine_client.process_pids}


class CacheConfigCollector(Collector):
    """vLLM's `vllm:cache_config_info`: 1, with the KV-cache configuration as labels."""

    def __init__(self, config: EngineConfig, engine_client: EngineClient) -> None:
        cache = config.cache
        self.labels = {
            "block_size": str(cache.block_size),
            "num_gpu_blocks": str(engine_client.num_kv_blocks),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "kv_cache_memory_gib": str(cache.kv_cache_memory_gib),
            "kv_cache_memory_bytes": str(None if cache.kv_cache_memory_gib is None
                                         else round(cache.kv_cache_memory_gib * 1024**3)),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
            "model_name": str(config.model.served_model_name or config.model.model),
        }

    def collect(self) -> Iterator[Any]:
        info = GaugeMetricFamily("vllm:cache_config_info",
                                 "Information of the LLMEngine CacheConfig",
                                 labels=list(self.labels))
        info.add_metric(list(self.labels.values()), 1.0)
        yield info
