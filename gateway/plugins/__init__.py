"""Plugins: the six groups, the one loader with vLLM's rules, each group's own rules, this
process's load report, and everything a plugin author codes against, from one import.

The guide is docs/plugins.md.
"""

from __future__ import annotations

from typing import Any

from gateway.lora_request import LoRARequest
from gateway.messages import FinishedRequestStats, IterationStats, SchedulerStats
from gateway.outputs import PoolingRequestOutput, RequestOutput
from gateway.plugins.contracts import (
    BatchUpdate,
    EndpointPlugin,
    EngineClient,
    IOProcessor,
    LogitsProcessor,
    LoRAResolver,
    MoveDirectionality,
    StatLoggerBase,
)
from gateway.plugins.general import load_general_plugins
from gateway.plugins.groups import (
    LoadedEndpointPlugin,
    StatLoggerPluginError,
    load_endpoint_plugins,
    load_io_processor,
    load_logits_processor_classes,
    load_stat_logger_classes,
)
from gateway.plugins.loader import (
    ALL_GROUPS,
    DEFAULT_PLUGINS_GROUP,
    ENDPOINT_PLUGINS_GROUP,
    GENERAL_PLUGINS_GROUP,
    IO_PROCESSOR_PLUGINS_GROUP,
    LOGITS_PROCESSORS_GROUP,
    PLATFORM_PLUGINS_GROUP,
    STAT_LOGGER_PLUGINS_GROUP,
    PluginError,
    allowlist_warnings,
    load_plugins_by_group,
)
from gateway.plugins.lora_resolvers import LORA_RESOLVERS_GROUP, LoRAResolverRegistry
from gateway.plugins.process import PluginProcess, load_report, start_process, this_process
from gateway.pooling_params import PoolingParams
from gateway.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "report":  # the earlier name of this process's report: `load_report()`
        return load_report()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def set_process_role(role: str) -> None:
    """Name this process (the gateway's earlier name for `start_process`)."""
    start_process(role)


def reset_for_tests() -> None:
    """Forget this process's plugin state and the discovery cache (tests only)."""
    from gateway.plugins import loader
    loader.reset_for_tests()


__all__ = [
    "ALL_GROUPS", "DEFAULT_PLUGINS_GROUP", "ENDPOINT_PLUGINS_GROUP", "GENERAL_PLUGINS_GROUP",
    "IO_PROCESSOR_PLUGINS_GROUP", "LOGITS_PROCESSORS_GROUP", "LORA_RESOLVERS_GROUP",
    "PLATFORM_PLUGINS_GROUP",
    "STAT_LOGGER_PLUGINS_GROUP", "BatchUpdate", "EndpointPlugin", "EngineClient",
    "FinishedRequestStats", "IOProcessor", "IterationStats", "LoadedEndpointPlugin",
    "LogitsProcessor", "LoRARequest", "LoRAResolver", "LoRAResolverRegistry",
    "MoveDirectionality", "PluginError", "PluginProcess", "PoolingParams",
    "PoolingRequestOutput", "RequestOutput", "SamplingParams", "SchedulerStats",
    "StatLoggerBase", "StatLoggerPluginError", "allowlist_warnings", "load_endpoint_plugins",
    "load_general_plugins", "load_io_processor", "load_logits_processor_classes",
    "load_plugins_by_group", "load_report", "load_stat_logger_classes", "reset_for_tests",
    "set_process_role", "start_process", "this_process",
]
