"""The stat-logger manager: built-ins beside the `vllm.stat_logger_plugins` (rule 9),
isolation of a failing logger, the periodic log and shutdown."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.metrics.loggers import LoggingStatLogger
from gateway.metrics.manager import StatLoggerManager, StatLoggerPluginError
from gateway.metrics.prometheus import PrometheusStatLogger
from gateway.plugins import STAT_LOGGER_PLUGINS_GROUP, PluginError, load_report
from tests.metrics.helpers import engine_config, exposition, outputs, value
from tests.plugin_dists import activate, forget_modules, write_dist

MODULE = "gw_test_stat_loggers"
SOURCE = '''
from gateway.plugins import StatLoggerBase

CALLS = []


class Recorder(StatLoggerBase):
    def record(self, scheduler_stats, iteration_stats, engine_idx=0):
        CALLS.append(("record", type(self).__name__, iteration_stats.num_generation_tokens))

    def log_engine_initialized(self):
        CALLS.append(("initialized", type(self).__name__, self.config.model.served_model_name))

    def log(self):
        CALLS.append(("log", type(self).__name__, None))


class Raises(Recorder):
    def record(self, scheduler_stats, iteration_stats, engine_idx=0):
        raise RuntimeError("record exploded")


class InitRaises(Recorder):
    def __init__(self, config, engine_index=0):
        raise ValueError("no billing file")


class NotALogger:
    pass


def a_function():
    pass
'''
ENTRY_POINTS = {"recorder": "Recorder", "raises": "Raises", "init_raises": "InitRaises",
                "not_a_logger": "NotALogger", "a_function": "a_function"}


@pytest.fixture
def stat_plugins(site, monkeypatch):
    """Installs the fake stat-logger distribution with the entry points named in the call."""
    def install(*names):
        write_dist(site, "gw-test-stat-loggers", {STAT_LOGGER_PLUGINS_GROUP: {
            name: f"{MODULE}:{ENTRY_POINTS[name]}" for name in names}}, {MODULE: SOURCE})
        activate(site, monkeypatch)
        # Only these plugins load (an installed example plugin must not change the counts).
        monkeypatch.setenv("VLLM_PLUGINS", ",".join(names))
        return __import__(MODULE).CALLS
    yield install
    forget_modules(MODULE)


def manager(**kwargs):
    return StatLoggerManager(engine_config(name="served"), "served", **kwargs)


def test_plugin_loggers_run_beside_the_built_in_ones(stat_plugins):
    calls = stat_plugins("recorder")
    stat_loggers = manager()
    assert [e.name for e in stat_loggers.entries] == ["logging", "prometheus", "recorder"]
    assert isinstance(stat_loggers.loggers[0], LoggingStatLogger)
    assert isinstance(stat_loggers.loggers[1], PrometheusStatLogger)
    stat_loggers.on_outputs(outputs(generated=5))
    assert calls == [("record", "Recorder", 5)]
    assert value(exposition(stat_loggers.registries.exposition),
                 "vllm:generation_tokens_total") == 5


def test_disable_log_stats_drops_only_the_logging_logger(stat_plugins):
    stat_plugins("recorder")
    stat_loggers = manager(enable_logging=False)
    assert [e.name for e in stat_loggers.entries] == ["prometheus", "recorder"]


def test_an_allowlist_without_the_plugin_keeps_the_built_ins(stat_plugins, monkeypatch):
    stat_plugins("recorder")
    monkeypatch.setenv("VLLM_PLUGINS", "some_endpoint_plugin")
    assert [e.name for e in manager().entries] == ["logging", "prometheus"]
    assert load_report().get(STAT_LOGGER_PLUGINS_GROUP, "recorder").outcome == "not-allowlisted"


@pytest.mark.parametrize("name, shown", [("not_a_logger", "NotALogger"),
                                         ("a_function", "a_function")])
def test_a_plugin_that_is_not_a_stat_logger_subclass_stops_start_up(stat_plugins, name, shown):
    stat_plugins("recorder", name)
    with pytest.raises(TypeError) as caught:
        manager()
    message = str(caught.value)
    assert isinstance(caught.value, PluginError)  # `gateway serve` reports it and exits 1
    for part in (repr(name), STAT_LOGGER_PLUGINS_GROUP, "gw-test-stat-loggers", shown,
                 "not a StatLoggerBase subclass", "process"):
        assert part in message
    assert load_report().get(STAT_LOGGER_PLUGINS_GROUP, name).outcome == "invalid-plugin"


def test_a_plugin_whose_constructor_raises_stops_start_up_naming_it(stat_plugins):
    stat_plugins("init_raises")
    with pytest.raises(StatLoggerPluginError, match="'init_raises'.*no billing file"):
        manager()
    assert load_report().get(STAT_LOGGER_PLUGINS_GROUP, "init_raises").outcome == "factory-failed"


def test_a_logger_that_raises_is_logged_once_an_interval_and_the_others_keep_running(
        stat_plugins, caplog):
    calls = stat_plugins("raises", "recorder")
    stat_loggers = manager()
    with caplog.at_level(logging.ERROR, logger="gateway"):
        for _ in range(3):
            stat_loggers.on_outputs(outputs(generated=1))
        stat_loggers.log()
        stat_loggers.on_outputs(outputs(generated=1))
    assert [c for c in calls if c[0] == "record"] == [("record", "Recorder", 1)] * 4
    assert value(exposition(stat_loggers.registries.exposition),
                 "vllm:generation_tokens_total") == 4
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.exc_info is not None for r in errors] == [True, False, True]
    assert "'raises' raised in record()" in errors[0].getMessage()
    assert "'raises' raised 3 times" in errors[1].getMessage()


def test_plugins_get_the_config_with_the_served_name_filled_in(stat_plugins):
    stat_plugins("recorder")
    stat_loggers = StatLoggerManager(engine_config(name=None, max_model_len=300), "served")
    plugin = stat_loggers.loggers[-1]
    assert plugin.config.model.served_model_name == "served"
    assert plugin.config.model.max_model_len == 300 and plugin.engine_index == 0


def test_start_logs_initialization_then_every_interval_and_once_at_shutdown(stat_plugins):
    calls = stat_plugins("recorder")
    stat_loggers = manager(log_interval_s=0.05)

    async def run():
        stat_loggers.start()
        await asyncio.sleep(0.18)
        await stat_loggers.shutdown()
        stat_loggers.on_outputs(outputs())  # after shutdown: ignored

    asyncio.run(run())
    assert calls[0] == ("initialized", "Recorder", "served")
    assert 2 <= sum(1 for c in calls if c[0] == "log") <= 5  # periodic ones and the last
    assert calls[-1][0] == "log" and not any(c[0] == "record" for c in calls)
