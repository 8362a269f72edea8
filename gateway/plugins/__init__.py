"""Plugins: the six groups, the loader with vLLM's rules, the load report, and the four
contracts a plugin author codes against (all importable from here)."""

from gateway.plugins.contracts import (
    BatchUpdate,
    EndpointPlugin,
    IOProcessor,
    LogitsProcessor,
    MoveDirectionality,
    StatLoggerBase,
)
from gateway.plugins.loader import (
    ALL_GROUPS,
    ENDPOINT_PLUGINS_GROUP,
    GENERAL_PLUGINS_GROUP,
    IO_PROCESSOR_PLUGINS_GROUP,
    LOGITS_PROCESSORS_GROUP,
    PLATFORM_PLUGINS_GROUP,
    STAT_LOGGER_PLUGINS_GROUP,
    PluginError,
    allowlist_warnings,
    load_endpoint_plugins,
    load_general_plugins,
    load_io_processor,
    load_plugins_by_group,
    report,
)
from gateway.plugins.load_report import set_process_role

__all__ = [
    "ALL_GROUPS", "ENDPOINT_PLUGINS_GROUP", "GENERAL_PLUGINS_GROUP",
    "IO_PROCESSOR_PLUGINS_GROUP", "LOGITS_PROCESSORS_GROUP", "PLATFORM_PLUGINS_GROUP",
    "STAT_LOGGER_PLUGINS_GROUP", "BatchUpdate", "EndpointPlugin", "IOProcessor",
    "LogitsProcessor", "MoveDirectionality", "PluginError", "StatLoggerBase",
    "allowlist_warnings", "load_endpoint_plugins", "load_general_plugins",
    "load_io_processor", "load_plugins_by_group", "report", "set_process_role",
]
