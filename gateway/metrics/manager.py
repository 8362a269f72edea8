"""The stat-logger manager: every stat logger of the API server, fed every engine step
(API-server process; made when the engine client is created, after its handshake).

It loads `vllm.stat_logger_plugins` with the one loader (VLLM_PLUGINS applies; a class
that is not a `StatLoggerBase` subclass, or whose constructor raises, stops start-up
naming it, rule 9), makes the built-in loggers (logging, unless `--disable-log-stats`, and
Prometheus) and one of each plugin class beside them, per engine with
`--data-parallel-size N`. Every `EngineCoreOutputs` batch that carries stats goes to each
logger's `record()`; `log()` runs every `log_interval_s` and at shutdown. Each call into
a logger is isolated: one that raises is logged (once per interval) and called again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import msgspec

from gateway.config import EngineConfig
from gateway.logger import init_logger
from gateway.messages import EngineCoreOutputs
from gateway.metrics.loggers import LoggingStatLogger
from gateway.metrics.prometheus import PrometheusStatLogger
from gateway.metrics.registry import MetricsRegistries, make_registries
from gateway.plugins import (
    STAT_LOGGER_PLUGINS_GROUP,
    EngineClient,
    StatLoggerBase,
    load_report,
)
from gateway.plugins.groups import StatLoggerPluginError, load_stat_logger_classes
from gateway.plugins.loader import discovered, record, where

logger = init_logger(__name__)

DEFAULT_LOG_INTERVAL_S = 5.0


@dataclass
class _Entry:
    name: str
    logger: StatLoggerBase
    is_plugin: bool
    engine_index: int = 0  # the engine whose stats it records (data parallel: one set each)
    num_errors: int = 0  # calls that raised since the last log()


class StatLoggerManager:
    """Every stat logger of one engine, fed by the engine client.

    With several API servers (`--api-server-count`), only API server 0 makes its loggers
    (`engine_stats=True`): the engine core sends the whole engine's iteration stats to it
    alone, so each logger runs once per engine and sees every request; the others make none.
    A logger that raises is logged with its traceback the first time, keeps being called, and
    does not disturb the others.

    The built-in loggers are not entry points, though STYLE 11 asks built-ins to go through
    the same door: VLLM_PLUGINS filters this group, so an operator who sets
    `VLLM_PLUGINS=my_endpoint` to enable one endpoint plugin would silently lose /metrics and
    the log line (rule 9: plugins run *beside* the built-ins); and the Prometheus logger needs
    the app's registry, which the plugin constructor `(config, engine_index)` cannot carry.
    They are listed, by name, in the start-up log line.
    """

    def __init__(self, engine_config: EngineConfig, model_name: str,
                 engine_client: EngineClient | None = None, *, enable_logging: bool = True,
                 registries: MetricsRegistries | None = None,
                 log_interval_s: float = DEFAULT_LOG_INTERVAL_S, engine_index: int = 0,
                 engine_stats: bool = True) -> None:
        """`engine_client`: the engine client whose outputs feed the loggers, or None to
        feed `on_outputs()` by hand. The loggers receive
        `engine_config` with `model.served_model_name` (and `max_model_len`, when the
        engine client knows it) filled in. `engine_stats` False: this process gets no
        engine stats (another API server runs the loggers), so none is made; the
        registries still hold this process's HTTP metrics."""
        self.config = _resolved_config(engine_config, model_name, engine_client)
        self.registries = registries or make_registries()
        self.engine_index = engine_index
        self.log_interval_s = log_interval_s
        self.entries: list[_Entry] = []
        self._task: asyncio.Task[None] | None = None
        self._interval_start = time.monotonic()
        self._closed = False
        # As vLLM: one logger of each kind per data-parallel engine, each fed that engine's
        # stats (the Prometheus ones share a table; their series differ by `engine`).
        self.num_engines = num_engines = engine_config.parallel.data_parallel_size
        if not engine_stats:
            logger.info("Stat loggers: none in this API server (API server 0 runs them for "
                        "the whole engine).")
            return
        plugin_classes = load_stat_logger_classes()  # rule 9 first: nothing made yet
        for index in range(num_engines) if num_engines > 1 else (engine_index,):
            if enable_logging:
                self._add("logging", LoggingStatLogger(self.config, index), False, index)
            self._add("prometheus", PrometheusStatLogger(self.config, index,
                                                         registries=self.registries),
                      False, index)
            for name, cls in plugin_classes.items():
                self._add(name, _instantiate(name, cls, self.config, index), True, index)
        if not engine_config.log_stats:
            logger.warning("The engine collects no iteration stats (log_stats is off): token "
                           "counters and latency histograms stay at 0.")
        if engine_client is not None:
            engine_client.add_outputs_listener(self.on_outputs)
        logger.info("Stat loggers: %s%s.", ", ".join(
            f"{e.name} ({'plugin' if e.is_plugin else 'built-in'})" for e in self.entries
            if e.engine_index == self.entries[0].engine_index),
            f", for each of {num_engines} engines" if num_engines > 1 else "")

    def _add(self, name: str, stat_logger: StatLoggerBase, is_plugin: bool,
             engine_index: int) -> None:
        self.entries.append(_Entry(name, stat_logger, is_plugin, engine_index))

    @property
    def loggers(self) -> list[StatLoggerBase]:
        return [entry.logger for entry in self.entries]

    # ------------------------------------------------------------------ feeding
    def on_outputs(self, outputs: EngineCoreOutputs) -> None:
        """The engine client's listener: one call per batch of engine outputs."""
        scheduler_stats, iteration_stats = outputs.scheduler_stats, outputs.iteration_stats
        if self._closed or (scheduler_stats is None and iteration_stats is None):
            return
        index = outputs.engine_index if self.num_engines > 1 else self.engine_index
        for entry in self.entries:
            if entry.engine_index != index:
                continue
            try:
                entry.logger.record(scheduler_stats, iteration_stats, index)
            except Exception as exc:
                self._failed(entry, "record", exc)

    def log(self) -> None:
        """Call every logger's `log()`; report the loggers that raised this interval."""
        now = time.monotonic()
        for entry in self.entries:
            try:
                entry.logger.log()
            except Exception as exc:
                self._failed(entry, "log", exc)
            if entry.num_errors > 1:
                logger.error("Stat logger %r raised %d times in the last %.0f s.", entry.name,
                             entry.num_errors, now - self._interval_start)
            entry.num_errors = 0
        self._interval_start = now

    def _failed(self, entry: _Entry, method: str, exc: Exception) -> None:
        entry.num_errors += 1
        if entry.is_plugin:
            load_report().note_runtime_error(STAT_LOGGER_PLUGINS_GROUP, entry.name,
                                      f"{method}(): {type(exc).__name__}: {exc}")
        if entry.num_errors == 1:
            logger.exception("Stat logger %r raised in %s(); it is still called, and the other "
                             "stat loggers run (its errors are logged once per interval).",
                             entry.name, method)

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Call `log_engine_initialized()` on each logger, then `log()` every interval
        (an asyncio task: call from the running event loop)."""
        for entry in self.entries:
            try:
                entry.logger.log_engine_initialized()
            except Exception as exc:
                self._failed(entry, "log_engine_initialized", exc)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._log_periodically())

    async def _log_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.log_interval_s)
            self.log()

    async def shutdown(self) -> None:
        """Stop the periodic task, log one last time, and stop recording."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if not self._closed:
            self.log()
            self._closed = True


def _instantiate(name: str, cls: type[StatLoggerBase], config: EngineConfig,
                 engine_index: int) -> StatLoggerBase:
    try:
        return cls(config, engine_index)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        record(STAT_LOGGER_PLUGINS_GROUP, name, "factory-failed", error=error)
        raise StatLoggerPluginError(f"Stat logger {_where(name)}: {cls.__qualname__}(config, "
                                    f"engine_index) raised {error}") from exc


def _where(name: str) -> str:
    return where(discovered(STAT_LOGGER_PLUGINS_GROUP, name))


def _resolved_config(config: EngineConfig, model_name: str,
                     engine_client: EngineClient | None) -> EngineConfig:
    known = engine_client.max_model_len if engine_client is not None else None
    max_model_len = known or config.model.max_model_len
    model = msgspec.structs.replace(config.model, served_model_name=model_name,
                                    max_model_len=max_model_len)
    return msgspec.structs.replace(config, model=model)
