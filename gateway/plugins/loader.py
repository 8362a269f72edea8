"""The plugin loader: one loader for every group, with vLLM's rules (DESIGN.md section 3)."""

from __future__ import annotations

import importlib
import time
import traceback
from collections.abc import Iterable
from typing import Any

from gateway import envs
from gateway.logger import init_logger
from gateway.plugins import discovery
from gateway.plugins.contracts import EndpointPlugin, IOProcessor
from gateway.plugins.discovery import DiscoveredPlugin
from gateway.plugins.load_report import LoadReport, process_role

logger = init_logger(__name__)

# Each group, and the processes that load it.
# Zero-argument functions, called at start-up of every process (front end, engine core,
# each worker, any helper subprocess), before the work that could use them.
GENERAL_PLUGINS_GROUP = "vllm.general_plugins"
# Functions returning a Platform qualname or None; every process that reads
# `current_platform`, the first time it is read.
PLATFORM_PLUGINS_GROUP = "vllm.platform_plugins"
# Functions returning an IOProcessor qualname or None; the front end, only when the model
# config (or --io-processor-plugin) names a plugin.
IO_PROCESSOR_PLUGINS_GROUP = "vllm.io_processor_plugins"
# StatLoggerBase subclasses; the front end, when the engine client is created.
STAT_LOGGER_PLUGINS_GROUP = "vllm.stat_logger_plugins"
# Zero-argument factories returning an EndpointPlugin; the front end, while the app is
# built, after all core routes. Default-deny: only names listed in VLLM_PLUGINS load.
ENDPOINT_PLUGINS_GROUP = "vllm.endpoint_plugins"
# LogitsProcessor subclasses; each worker, when the sampler is built. Not filtered by
# VLLM_PLUGINS.
LOGITS_PROCESSORS_GROUP = "vllm.logits_processors"

ALL_GROUPS = (GENERAL_PLUGINS_GROUP, PLATFORM_PLUGINS_GROUP, IO_PROCESSOR_PLUGINS_GROUP,
              STAT_LOGGER_PLUGINS_GROUP, ENDPOINT_PLUGINS_GROUP, LOGITS_PROCESSORS_GROUP)
_UNFILTERED_GROUPS = frozenset({LOGITS_PROCESSORS_GROUP})

# Process-level state, all of it: the report and the once-per-process flag.
report = LoadReport()
_general_plugins_loaded = False


class PluginError(RuntimeError):
    """A plugin problem that stops start-up; the message names plugin, group, distribution
    and process."""


def where(plugin: DiscoveredPlugin) -> str:
    """'plugin NAME (group G, distribution D) in process ROLE (pid N)'."""
    import os
    return (f"plugin {plugin.name!r} (group {plugin.group}, distribution {plugin.distribution}) "
            f"in process {process_role()} (pid {os.getpid()})")


def is_allowed(group: str, name: str, allowlist: list[str] | None) -> bool:
    """Rule 2 (and rule 3's default-deny for endpoint plugins)."""
    if group in _UNFILTERED_GROUPS:
        return True
    if allowlist is None:
        return group != ENDPOINT_PLUGINS_GROUP
    return name in allowlist


def load_plugins_by_group(group: str) -> dict[str, Any]:
    """Discover `group`'s entry points, keep the allowed ones, import each, and return
    {name: object} without calling anything (rule 1).

    An entry point whose import fails is logged with its traceback and skipped (rule 5).
    When two distributions give the same name in one group, the first in sys.path order
    is loaded and the other is recorded as `duplicate-name`.
    """
    allowlist = envs.vllm_plugins()
    plugins: dict[str, Any] = {}
    chosen: dict[str, DiscoveredPlugin] = {}
    for plugin in discovery.discover(group):
        if not is_allowed(group, plugin.name, allowlist):
            _record(plugin, "not-allowlisted")
            continue
        if plugin.name in chosen:
            first = chosen[plugin.name]
            logger.warning("Plugin name %r appears twice in group %s: distribution %s is "
                           "loaded, %s is ignored.", plugin.name, group, first.distribution,
                           plugin.distribution)
            _record(plugin, "duplicate-name",
                    error=f"name already taken by distribution {first.distribution}")
            continue
        chosen[plugin.name] = plugin
        loaded, obj = _import(plugin)
        if loaded:
            plugins[plugin.name] = obj
    return plugins


def _import(plugin: DiscoveredPlugin) -> tuple[bool, Any]:
    if not plugin.is_well_formed:
        msg = f"malformed entry point value {plugin.value!r} (expected 'module:attr')"
        logger.error("Skipping %s: %s", where(plugin), msg)
        _record(plugin, "malformed", error=msg)
        return False, None
    start = time.perf_counter()
    try:
        obj: Any = importlib.import_module(plugin.module)
        for part in (plugin.attr or "").split("."):
            if part:
                obj = getattr(obj, part)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit at import must not end the process either
        elapsed = time.perf_counter() - start
        logger.error("Failed to load %s; skipped.\n%s", where(plugin), traceback.format_exc())
        _record(plugin, "import-failed", error=_error_text(exc), load_time_s=elapsed)
        return False, None
    _record(plugin, "loaded", load_time_s=time.perf_counter() - start)
    return True, obj


def load_general_plugins() -> None:
    """Call every allowed general plugin, once per process (rule 4).

    The flag is set before any plugin runs, so a plugin that re-enters (or a second call)
    returns at once. A plugin that raises stops start-up (rule 6): PluginError names it.
    """
    global _general_plugins_loaded
    if _general_plugins_loaded:
        return
    _general_plugins_loaded = True
    for name, func in load_plugins_by_group(GENERAL_PLUGINS_GROUP).items():
        plugin = _discovered(GENERAL_PLUGINS_GROUP, name)
        start = time.perf_counter()
        try:
            if not callable(func):
                raise TypeError(f"the entry point's object {func!r} is not callable")
            func()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            _record(plugin, "call-failed", error=_error_text(exc))
            raise PluginError(f"General {where(plugin)} raised: {_error_text(exc)}") from exc
        _record(plugin, "called", load_time_s=time.perf_counter() - start)


def load_endpoint_plugins(supported_tasks: Iterable[str]) -> list[EndpointPlugin]:
    """Return the endpoint plugins to attach, in discovery order (rules 3 and 5).

    Only names listed in VLLM_PLUGINS load; with it unset none does, and a WARNING names
    those found. Each factory call and contract check is isolated: a failure skips that
    plugin alone. A plugin whose `required_tasks` misses the model's tasks is skipped.
    """
    tasks = tuple(supported_tasks)
    found = discovery.discover(ENDPOINT_PLUGINS_GROUP)
    if envs.vllm_plugins() is None and found:
        logger.warning("Endpoint plugins are installed but none is loaded, because "
                       "VLLM_PLUGINS is unset (endpoint plugins load only when named): %s. "
                       "Set VLLM_PLUGINS to the names to enable.",
                       ", ".join(f"{p.name} ({p.distribution})" for p in found))
    plugins: list[EndpointPlugin] = []
    for name, factory in load_plugins_by_group(ENDPOINT_PLUGINS_GROUP).items():
        plugin = _discovered(ENDPOINT_PLUGINS_GROUP, name)
        made = _make_endpoint_plugin(plugin, factory)
        if made is None:
            continue
        required = made.required_tasks
        if required is not None and not set(required) & set(tasks):
            logger.info("Endpoint plugin %r skipped: it requires tasks %s and the server "
                        "supports %s.", name, list(required), list(tasks))
            _record(plugin, "skipped-tasks",
                    detail=f"requires {list(required)}; server supports {list(tasks)}")
            continue
        plugins.append(made)
    return plugins


def _make_endpoint_plugin(plugin: DiscoveredPlugin, factory: Any) -> EndpointPlugin | None:
    try:
        made = factory()
    except Exception as exc:
        logger.error("Endpoint %s: its factory raised; skipped.\n%s", where(plugin),
                     traceback.format_exc())
        _record(plugin, "factory-failed", error=_error_text(exc))
        return None
    problem = endpoint_contract_problem(made)
    if problem is not None:
        logger.error("Endpoint %s: %s; skipped.", where(plugin), problem)
        _record(plugin, "invalid-plugin", error=problem)
        return None
    return made  # type: ignore[no-any-return]


def endpoint_contract_problem(obj: Any) -> str | None:
    """Why `obj` is not a usable EndpointPlugin, or None when it is."""
    members = ("name", "required_tasks", "attach_router", "init_state")
    missing = [m for m in members if not hasattr(obj, m)]
    if missing or not isinstance(obj, EndpointPlugin):
        return f"the factory returned {type(obj).__name__}, not an EndpointPlugin " \
               f"(missing: {', '.join(missing) or 'none'})"
    required = obj.required_tasks
    if required is not None and (isinstance(required, str) or not all(
            isinstance(t, str) for t in required)):
        return f"required_tasks must be None or a tuple of task names, got {required!r}"
    return None


def load_io_processor(name: str | None) -> type[IOProcessor] | None:
    """Rule 8: the IO-processor class named by `--io-processor-plugin` or the model
    config, or None when neither names one (then the group is not even discovered).

    The group is loaded with the allowlist (rule 1); the named entry's function is called
    and must return the qualname ('module.Class' or 'module:Class') of an IOProcessor
    subclass. Raises PluginError, listing the available plugins, when the named one is not
    installed, not allowed, failed to import, is inactive or is not an IOProcessor.
    """
    if name is None:
        return None
    group = IO_PROCESSOR_PLUGINS_GROUP
    plugins = load_plugins_by_group(group)
    if name not in plugins:
        available = ", ".join(sorted(plugins)) or "none"
        raise PluginError(f"IO processor plugin {name!r} is not installed, not allowed by "
                          f"VLLM_PLUGINS, or failed to import (see the log); available: "
                          f"{available}")
    plugin = _discovered(group, name)
    try:
        qualname = plugins[name]()
        cls = None if qualname is None else _resolve_qualname(str(qualname))
    except Exception as exc:
        _record(plugin, "factory-failed", error=_error_text(exc))
        raise PluginError(f"{where(plugin)} failed: {_error_text(exc)}") from exc
    if cls is None:
        _record(plugin, "inactive")
        raise PluginError(f"{where(plugin)} is inactive (its function returned None)")
    if not (isinstance(cls, type) and issubclass(cls, IOProcessor)):
        msg = f"{qualname!r} is not a subclass of gateway.plugins.IOProcessor"
        _record(plugin, "invalid-plugin", error=msg)
        raise PluginError(f"{where(plugin)}: {msg}")
    _record(plugin, "selected", detail=f"{cls.__module__}.{cls.__qualname__}")
    logger.info("IO processor: %s (%s.%s)", name, cls.__module__, cls.__qualname__)
    return cls


def _resolve_qualname(qualname: str) -> Any:
    module_name, sep, attr = qualname.partition(":")
    if not sep:
        module_name, _, attr = qualname.rpartition(".")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def allowlist_warnings() -> list[str]:
    """Allowlist hygiene (DESIGN "Beyond the reference"), logged as WARNINGs.

    A name in VLLM_PLUGINS that matches no discovered entry point; and, when it is set,
    the discovered plugins of the filtered non-endpoint groups that it leaves out.
    """
    allowlist = envs.vllm_plugins()
    if allowlist is None:
        return []
    found = discovery.discover_all()
    known = {p.name for plugins in found.values() for p in plugins}
    warnings = [f"VLLM_PLUGINS names {name!r}, which matches no installed plugin in any group."
                for name in allowlist if name and name not in known]
    excluded = [f"{p.name} ({p.group})" for group in ALL_GROUPS
                if group not in _UNFILTERED_GROUPS and group != ENDPOINT_PLUGINS_GROUP
                for p in found.get(group, []) if p.name not in allowlist]
    if excluded:
        warnings.append("VLLM_PLUGINS is set, so these installed plugins are not loaded: "
                        + ", ".join(excluded))
    for line in warnings:
        logger.warning(line)
    return warnings


def record(group: str, name: str, outcome: str, **kwargs: Any) -> None:
    """Record a later outcome (attached, init-failed, selected, ...) for a discovered plugin."""
    _record(_discovered(group, name), outcome, **kwargs)


def _discovered(group: str, name: str) -> DiscoveredPlugin:
    for plugin in discovery.discover(group):
        if plugin.name == name:
            return plugin
    return DiscoveredPlugin(group, name, "", "<not installed>")


def _record(plugin: DiscoveredPlugin, outcome: str, **kwargs: Any) -> None:
    report.record(plugin.group, plugin.name, plugin.value, plugin.distribution, outcome,
                  **kwargs)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def reset_for_tests() -> None:
    """Forget the once-per-process flag, the report and the discovery cache (tests only)."""
    global _general_plugins_loaded
    _general_plugins_loaded = False
    report.clear()
    discovery.reset_cache()
