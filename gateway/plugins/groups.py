"""Each group's own rules on top of the one loader: what its object must be, what happens
to one that is not, and what is recorded. The front end, the engine core, the workers and
`gateway plugins --check` all call these, so the preflight cannot drift from serving.

Guide: docs/plugins.md, "The six groups".
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway import envs
from gateway.logger import init_logger
from gateway.plugins import discovery
from gateway.plugins.contracts import (
    EndpointPlugin,
    EngineClient,
    IOProcessor,
    LogitsProcessor,
    StatLoggerBase,
)
from gateway.plugins.loader import (
    ENDPOINT_PLUGINS_GROUP,
    IO_PROCESSOR_PLUGINS_GROUP,
    LOGITS_PROCESSORS_GROUP,
    STAT_LOGGER_PLUGINS_GROUP,
    PluginError,
    discovered,
    error_text,
    import_object,
    load_plugins_by_group,
    record,
    where,
)
from gateway.plugins.process import load_report, this_process
from gateway.plugins.records import FAILED_OUTCOMES

if TYPE_CHECKING:
    from fastapi import FastAPI

logger = init_logger(__name__)


# --------------------------------------------------------------------------- endpoints
@dataclass
class LoadedEndpointPlugin:
    """An endpoint plugin with the entry-point name it was loaded under (the name
    VLLM_PLUGINS lists). It is an EndpointPlugin itself: code written for vLLM's
    `load_endpoint_plugins`, which returns the plugins, runs unchanged."""

    entry_name: str
    plugin: EndpointPlugin

    @property
    def name(self) -> str:
        return self.plugin.name

    @property
    def required_tasks(self) -> tuple[str, ...] | None:
        return self.plugin.required_tasks

    def attach_router(self, app: FastAPI) -> None:
        self.plugin.attach_router(app)

    async def init_state(self, engine_client: EngineClient, state: Any, args: Any) -> None:
        await self.plugin.init_state(engine_client, state, args)


def load_endpoint_plugins(supported_tasks: Iterable[str] | None = None
                          ) -> list[LoadedEndpointPlugin]:
    """The endpoint plugins to attach, in discovery order (rules 3 and 5).

    Only names listed in VLLM_PLUGINS load; with it unset none does (the group is not even
    imported), and a WARNING names those found. Each factory call and contract check is
    isolated: a failure skips that plugin alone. A plugin whose `required_tasks` is not
    None loads only when it meets `supported_tasks`; with `supported_tasks` None (vLLM's
    default) no such plugin loads.
    """
    tasks = None if supported_tasks is None else tuple(supported_tasks)
    found = discovery.discover(ENDPOINT_PLUGINS_GROUP)
    if envs.vllm_plugins() is None:
        if found:
            logger.warning("Endpoint plugins are installed but none is loaded, because "
                           "VLLM_PLUGINS is unset (endpoint plugins load only when named): "
                           "%s. Set VLLM_PLUGINS to the names to enable.",
                           ", ".join(f"{p.name} ({p.distribution})" for p in found))
            for plugin in found:
                record(ENDPOINT_PLUGINS_GROUP, plugin.name, "not-allowlisted")
        return []
    plugins: list[LoadedEndpointPlugin] = []
    for name, factory in load_plugins_by_group(ENDPOINT_PLUGINS_GROUP).items():
        made = _make_endpoint_plugin(name, factory)
        if made is None:
            continue
        required = made.required_tasks
        if required is not None and (tasks is None or not set(required) & set(tasks)):
            have = "none given" if tasks is None else list(tasks)
            logger.info("Endpoint plugin %r skipped: it requires tasks %s and the server "
                        "supports %s.", name, list(required), have)
            record(ENDPOINT_PLUGINS_GROUP, name, "skipped-tasks",
                   detail=f"requires {list(required)}; server supports {have}")
            continue
        plugins.append(LoadedEndpointPlugin(name, made))
    return plugins


def _make_endpoint_plugin(name: str, factory: Any) -> EndpointPlugin | None:
    plugin = discovered(ENDPOINT_PLUGINS_GROUP, name)
    try:
        made = factory()
    except Exception as exc:
        logger.exception("Endpoint %s: its factory raised; skipped.", where(plugin))
        record(ENDPOINT_PLUGINS_GROUP, name, "factory-failed", error=error_text(exc))
        return None
    problem = endpoint_contract_problem(made)
    if problem is not None:
        logger.error("Endpoint %s: %s; skipped.", where(plugin), problem)
        record(ENDPOINT_PLUGINS_GROUP, name, "invalid-plugin", error=problem)
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


# --------------------------------------------------------------------------- IO processors
def load_io_processor(name: str | None) -> type[IOProcessor[Any, Any]] | None:
    """Rule 8: the IO-processor class named by `--io-processor-plugin` or the model
    config, or None when neither names one (then the group is not even discovered).

    The named entry's function is called and must return the qualname ('module.Class' or
    'module:Class') of an IOProcessor subclass. Raises PluginError, listing the available
    plugins, when the named one is not installed, not allowed, failed to import, is
    inactive or is not an IOProcessor.
    """
    if name is None:
        for plugin in discovery.discover(IO_PROCESSOR_PLUGINS_GROUP):
            record(IO_PROCESSOR_PLUGINS_GROUP, plugin.name, "not-requested")
        return None
    group = IO_PROCESSOR_PLUGINS_GROUP
    plugins = load_plugins_by_group(group)
    if name not in plugins:
        available = ", ".join(sorted(plugins)) or "none"
        raise PluginError(f"IO processor plugin {name!r} is not installed, not allowed by "
                          f"VLLM_PLUGINS, or failed to import (see the log); available: "
                          f"{available}")
    plugin = discovered(group, name)
    try:
        qualname = plugins[name]()
        cls = None if qualname is None else resolve_qualname(str(qualname))
    except Exception as exc:
        record(group, name, "factory-failed", error=error_text(exc))
        raise PluginError(f"{where(plugin)} failed: {error_text(exc)}") from exc
    if cls is None:
        record(group, name, "inactive")
        raise PluginError(f"{where(plugin)} is inactive (its function returned None)")
    if not (isinstance(cls, type) and issubclass(cls, IOProcessor)):
        msg = f"{qualname!r} is not a subclass of gateway.plugins.IOProcessor"
        record(group, name, "invalid-plugin", error=msg)
        raise PluginError(f"{where(plugin)}: {msg}")
    record(group, name, "selected", detail=f"{cls.__module__}.{cls.__qualname__}")
    logger.info("IO processor: %s (%s.%s)", name, cls.__module__, cls.__qualname__)
    return cls


def resolve_qualname(qualname: str, *, hide_cuda: bool = False) -> Any:
    """The object named "module:attr" or "module.attr"."""
    module_name, sep, attr = qualname.partition(":")
    if not sep:
        module_name, _, attr = qualname.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{qualname!r} is not of the form 'module:Class'")
    return import_object(module_name, attr, hide_cuda=hide_cuda)


# --------------------------------------------------------------------------- stat loggers
class StatLoggerPluginError(PluginError, TypeError):
    """A stat-logger plugin that cannot run: not a StatLoggerBase subclass (rule 9's
    TypeError), or its constructor raised. Start-up stops."""


def load_stat_logger_classes() -> dict[str, type[StatLoggerBase]]:
    """The allowed `vllm.stat_logger_plugins` classes (rule 9: anything else raises a
    StatLoggerPluginError naming the plugin)."""
    classes = {}
    for name, obj in load_plugins_by_group(STAT_LOGGER_PLUGINS_GROUP).items():
        if not (isinstance(obj, type) and issubclass(obj, StatLoggerBase)):
            message = f"{obj!r} is not a StatLoggerBase subclass"
            record(STAT_LOGGER_PLUGINS_GROUP, name, "invalid-plugin", error=message)
            raise StatLoggerPluginError(
                f"Stat logger {where(discovered(STAT_LOGGER_PLUGINS_GROUP, name))}: "
                f"{message}.")
        classes[name] = obj
    return classes


# --------------------------------------------------------------------------- logits processors
#: The load report's distribution for processors named on the command line.
COMMAND_LINE = "<command line>"


def load_logits_processor_classes(qualnames: Sequence[str] = ()
                                  ) -> list[type[LogitsProcessor]]:
    """Every logits-processor class to run (rule 10): the `vllm.logits_processors` plugins
    first, then the "module:Class" names of `--logits-processors`; each class once.

    Imported with CUDA hidden. Unlike the other groups, a processor that fails to load
    stops start-up (serving without it would change outputs silently): PluginError when it
    fails to import, TypeError when it is not a `LogitsProcessor` subclass, each naming it
    and this process.
    """
    classes = _plugin_classes()
    classes += [_named_class(qualname) for qualname in qualnames]
    return list(dict.fromkeys(classes))  # the same class named twice runs once


def _plugin_classes() -> list[type[LogitsProcessor]]:
    loaded = load_plugins_by_group(LOGITS_PROCESSORS_GROUP)
    failed = [r for r in load_report().records(LOGITS_PROCESSORS_GROUP)
              if r.outcome in FAILED_OUTCOMES and r.distribution != COMMAND_LINE]
    if failed:
        raise PluginError("; ".join(
            f"Logits processor plugin {r.name!r} (group {r.group}, distribution "
            f"{r.distribution}) failed to load in process {r.process_role} (pid {r.pid}): "
            f"{r.outcome}: {r.error}" for r in failed)
            + ". A logits processor that does not load stops start-up (it would change "
              "outputs silently).")
    classes = []
    for name, obj in loaded.items():
        if not is_logits_processor_class(obj):
            problem = f"{obj!r} is not a subclass of gateway.plugins.LogitsProcessor"
            record(LOGITS_PROCESSORS_GROUP, name, "invalid-plugin", error=problem)
            raise TypeError(f"Logits processor "
                            f"{where(discovered(LOGITS_PROCESSORS_GROUP, name))}: {problem}.")
        classes.append(obj)
    return classes


def _named_class(qualname: str) -> type[LogitsProcessor]:
    """Import "module:Class" (or "module.Class") named by `--logits-processors`."""
    here = f"in {this_process().where()}"
    start = time.perf_counter()
    try:
        obj = resolve_qualname(qualname, hide_cuda=True)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a SystemExit at import must name the class too
        _record_named(qualname, "import-failed", error=error_text(exc))
        raise PluginError(f"Logits processor {qualname!r} named by --logits-processors "
                          f"failed to load {here}: {error_text(exc)}") from exc
    if not is_logits_processor_class(obj):
        problem = f"{obj!r} is not a subclass of gateway.plugins.LogitsProcessor"
        _record_named(qualname, "invalid-plugin", error=problem)
        raise TypeError(f"Logits processor {qualname!r} named by --logits-processors "
                        f"{here}: {problem}.")
    _record_named(qualname, "loaded", load_time_s=time.perf_counter() - start)
    return obj  # type: ignore[no-any-return]


def is_logits_processor_class(obj: object) -> bool:
    return isinstance(obj, type) and issubclass(obj, LogitsProcessor)


def _record_named(qualname: str, outcome: str, **kwargs: Any) -> None:
    load_report().record(LOGITS_PROCESSORS_GROUP, qualname, qualname, COMMAND_LINE, outcome,
                         **kwargs)
