"""The one loader every group goes through, and the allowlist (every process).

Rules and log lines are vLLM's (docs/plugins.md, "The allowlist"); where the
gateway is stricter on purpose, the guide's "Differences from vLLM" says why and the log
line says so when it applies.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

from gateway import envs
from gateway.logger import init_logger
from gateway.plugins import discovery
from gateway.plugins.discovery import DiscoveredPlugin
from gateway.plugins.process import load_report, this_process

logger = init_logger(__name__)

# Each group, and the processes that load it (docs/plugins.md, "The six groups").
# Zero-argument functions, called at start-up of every process (front end, engine core,
# each worker, the offline LLM's own process), before the work that could use them.
DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"
GENERAL_PLUGINS_GROUP = DEFAULT_PLUGINS_GROUP  # the gateway's earlier name
# Functions returning a Platform qualname or None; every process that reads
# `current_platform`, the first time it is read (each process does, before its general
# plugins run).
PLATFORM_PLUGINS_GROUP = "vllm.platform_plugins"
# Functions returning an IOProcessor qualname or None; the front end, only when the model
# config (or --io-processor-plugin) names a plugin.
IO_PROCESSOR_PLUGINS_GROUP = "vllm.io_processor_plugins"
# StatLoggerBase subclasses; the front end, when the engine client is created.
STAT_LOGGER_PLUGINS_GROUP = "vllm.stat_logger_plugins"
# Zero-argument factories returning an EndpointPlugin; the front end, while the app is
# built, after all core routes. Default-deny: only names listed in VLLM_PLUGINS load.
ENDPOINT_PLUGINS_GROUP = "vllm.endpoint_plugins"
# LogitsProcessor subclasses; where the sampler is built (each worker), imported with
# CUDA hidden. Not filtered by VLLM_PLUGINS.
LOGITS_PROCESSORS_GROUP = "vllm.logits_processors"

ALL_GROUPS = (DEFAULT_PLUGINS_GROUP, PLATFORM_PLUGINS_GROUP, IO_PROCESSOR_PLUGINS_GROUP,
              STAT_LOGGER_PLUGINS_GROUP, ENDPOINT_PLUGINS_GROUP, LOGITS_PROCESSORS_GROUP)
UNFILTERED_GROUPS = frozenset({LOGITS_PROCESSORS_GROUP})
# Groups whose modules are imported with CUDA_VISIBLE_DEVICES="" (see `cuda_hidden`).
_CUDA_HIDDEN_GROUPS = frozenset({LOGITS_PROCESSORS_GROUP})
_DIFFERENCES = "see docs/plugins.md, 'Differences from vLLM'"


class PluginError(RuntimeError):
    """A plugin problem that stops start-up; the message names plugin, group, distribution
    and process."""


def where(plugin: DiscoveredPlugin) -> str:
    """'plugin NAME (group G, distribution D) in process ROLE (pid N)'."""
    return (f"plugin {plugin.name!r} (group {plugin.group}, distribution {plugin.distribution}) "
            f"in {this_process().where()}")


def is_allowed(group: str, name: str, allowlist: list[str] | None) -> bool:
    """Rule 2 (and rule 3's default-deny for endpoint plugins)."""
    if group in UNFILTERED_GROUPS:
        return True
    if allowlist is None:
        return group != ENDPOINT_PLUGINS_GROUP
    return name in allowlist


def load_plugins_by_group(group: str) -> dict[str, Any]:
    """Discover `group`'s entry points, keep the allowed ones, import each, and return
    {name: object} without calling anything (rule 1).

    Logs vLLM's lines: the available plugins (INFO, DEBUG for the general group), whether
    all will load, "Loading plugin NAME" when VLLM_PLUGINS is set, and "Failed to load
    plugin NAME" with the traceback for an import that fails (skipped, rule 5). When two
    distributions give one name in a group, the first in sys.path order loads.
    """
    found = discovery.discover(group)
    if not found:
        logger.debug("No plugins for group %s found.", group)
        return {}
    allowlist = envs.vllm_plugins()
    level = logging.DEBUG if group == DEFAULT_PLUGINS_GROUP else logging.INFO
    logger.log(level, "Available plugins for group %s:", group)
    for plugin in found:
        logger.log(level, "- %s -> %s", plugin.name, plugin.value)
    # Not for the endpoint group (default-deny) nor the groups VLLM_PLUGINS does not filter.
    if allowlist is None and group != ENDPOINT_PLUGINS_GROUP and group not in UNFILTERED_GROUPS:
        logger.log(level, "All plugins in this group will be loaded. "
                   "Set `VLLM_PLUGINS` to control which plugins to load.")
    plugins: dict[str, Any] = {}
    chosen: dict[str, DiscoveredPlugin] = {}
    for plugin in found:
        if not is_allowed(group, plugin.name, allowlist):
            record_plugin(plugin, "not-allowlisted")
            continue
        if allowlist is not None and group not in UNFILTERED_GROUPS:
            logger.log(level, "Loading plugin %s", plugin.name)
        if plugin.name in chosen:
            _record_duplicate(plugin, chosen[plugin.name])
            continue
        chosen[plugin.name] = plugin
        loaded, obj = _import(plugin)
        if loaded:
            plugins[plugin.name] = obj
    return plugins


def _record_duplicate(plugin: DiscoveredPlugin, first: DiscoveredPlugin) -> None:
    logger.warning("Plugin name %r appears twice in group %s: distribution %s is loaded, %s "
                   "is ignored (vLLM would load the last one; the gateway keeps the first, "
                   "as the import system would: %s).", plugin.name, plugin.group,
                   first.distribution, plugin.distribution, _DIFFERENCES)
    record_plugin(plugin, "duplicate-name",
            error=f"name already taken by distribution {first.distribution}")


def _import(plugin: DiscoveredPlugin) -> tuple[bool, Any]:
    if not plugin.is_well_formed:
        msg = f"malformed entry point value {plugin.value!r} (expected 'module:attr')"
        logger.error("Failed to load plugin %s: %s (group %s, distribution %s, %s); "
                     "skipped.", plugin.name, msg, plugin.group, plugin.distribution,
                     this_process().where())
        record_plugin(plugin, "malformed", error=msg)
        return False, None
    start = time.perf_counter()
    try:
        obj = import_object(plugin.module, plugin.attr or "",
                            hide_cuda=plugin.group in _CUDA_HIDDEN_GROUPS)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit at import must not end the process either
        logger.exception("Failed to load plugin %s (group %s, distribution %s, %s); "
                         "skipped.", plugin.name, plugin.group, plugin.distribution,
                         this_process().where())
        record_plugin(plugin, "import-failed", error=error_text(exc),
                load_time_s=time.perf_counter() - start)
        return False, None
    record_plugin(plugin, "loaded", load_time_s=time.perf_counter() - start)
    return True, obj


def import_object(module_name: str, attr: str, *, hide_cuda: bool = False) -> Any:
    """Import `module_name` and walk the dotted `attr` ("" for the module itself)."""
    with cuda_hidden() if hide_cuda else contextlib.nullcontext():
        obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        if part:
            obj = getattr(obj, part)
    return obj


@contextlib.contextmanager
def cuda_hidden() -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES="" while the block runs, then the value before (or unset).

    A logits-processor module that touches CUDA at import (a tensor made at module level,
    a device query) then fails or sees no device, instead of initialising CUDA in a
    process before its device is chosen, as vLLM guards that group too.
    """
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def allowlist_warnings() -> list[str]:
    """Allowlist hygiene (docs/plugins.md, "The allowlist"), logged as WARNINGs.

    A name in VLLM_PLUGINS that matches no discovered entry point; one the gateway matched
    only after stripping its spaces; and, when it is set, the discovered plugins of the
    filtered non-endpoint groups that it leaves out.
    """
    allowlist = envs.vllm_plugins()
    if allowlist is None:
        return []
    found = discovery.discover_all()
    known = {p.name for plugins in found.values() for p in plugins}
    warnings = [f"VLLM_PLUGINS names {name!r}, which matches no installed plugin in any group."
                for name in allowlist if name and name not in known]
    raw = os.environ.get("VLLM_PLUGINS", "").split(",")
    padded = [name for name in raw if name.strip() and name != name.strip()
              and name.strip() in known]
    if padded:
        warnings.append("VLLM_PLUGINS has spaces around " + ", ".join(map(repr, padded))
                        + f": the gateway strips them, vLLM would match no plugin "
                          f"({_DIFFERENCES}).")
    excluded = [f"{p.name} ({p.group})" for group in ALL_GROUPS
                if group not in UNFILTERED_GROUPS and group != ENDPOINT_PLUGINS_GROUP
                for p in found.get(group, []) if p.name not in allowlist]
    if excluded:
        warnings.append("VLLM_PLUGINS is set, so these installed plugins are not loaded: "
                        + ", ".join(excluded))
    for line in warnings:
        logger.warning(line)
    return warnings


def record(group: str, name: str, outcome: str, **kwargs: Any) -> None:
    """Record a later outcome (attached, init-failed, selected, ...) for a discovered plugin."""
    record_plugin(discovered(group, name), outcome, **kwargs)


def discovered(group: str, name: str) -> DiscoveredPlugin:
    for plugin in discovery.discover(group):
        if plugin.name == name:
            return plugin
    return DiscoveredPlugin(group, name, "", "<not installed>")


def record_plugin(plugin: DiscoveredPlugin, outcome: str, **kwargs: Any) -> None:
    load_report().record(plugin.group, plugin.name, plugin.value, plugin.distribution,
                         outcome, **kwargs)


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def reset_for_tests() -> None:
    """Forget this process's plugin state and the discovery cache (tests only)."""
    from gateway.plugins import process
    process.reset_for_tests()
    discovery.reset_cache()
