"""vLLM's public names, signatures and log lines in gateway.plugins (issue 13, item 1)."""

from __future__ import annotations

import logging
import os

import pytest

import gateway.plugins as plugins
from gateway.plugins import (
    DEFAULT_PLUGINS_GROUP,
    ENDPOINT_PLUGINS_GROUP,
    GENERAL_PLUGINS_GROUP,
    LOGITS_PROCESSORS_GROUP,
    STAT_LOGGER_PLUGINS_GROUP,
    EndpointPlugin,
    allowlist_warnings,
    load_endpoint_plugins,
    load_logits_processor_classes,
    load_plugins_by_group,
    load_report,
)
from tests.conftest import run_python
from tests.plugin_dists import ENDPOINT_PLUGIN_CLASS, activate, forget_modules, write_dist

ENDPOINTS = ENDPOINT_PLUGIN_CLASS + """
    def anywhere():
        return Plugin("anywhere-plugin", None)
    def generate_only():
        return Plugin("gen-plugin", ("generate",))
"""

GROUP_MODULE = """
    def func():
        return None
"""

CUDA_PROBE = """
    import os
    with open(os.environ["CUDA_PROBE"], "w") as f:
        f.write(repr(os.environ.get("CUDA_VISIBLE_DEVICES")))
    from gateway.plugins import LogitsProcessor
    class Probe(LogitsProcessor):
        def is_argmax_invariant(self): return True
        def update_state(self, batch_update): pass
        def apply(self, logits): return logits
"""


@pytest.fixture
def endpoints(site, monkeypatch):
    write_dist(site, "vllm-api-endpoints", {ENDPOINT_PLUGINS_GROUP: {
        "anywhere": "api_eps:anywhere", "gen": "api_eps:generate_only"}}, {"api_eps": ENDPOINTS})
    activate(site, monkeypatch)
    monkeypatch.setenv("VLLM_PLUGINS", "anywhere,gen")
    yield
    forget_modules("api_eps")


@pytest.fixture
def stat_group(site, monkeypatch):
    """Two entry points in a non-default group and two in the general group, one broken."""
    write_dist(site, "vllm-api-groups", {
        STAT_LOGGER_PLUGINS_GROUP: {"first": "api_group:func", "broken": "api_missing:func"},
        DEFAULT_PLUGINS_GROUP: {"gen_one": "api_group:func"}}, {"api_group": GROUP_MODULE})
    activate(site, monkeypatch)
    yield
    forget_modules("api_group")


def test_default_plugins_group_is_vllms_constant_and_the_old_name_is_an_alias():
    assert DEFAULT_PLUGINS_GROUP == "vllm.general_plugins" == GENERAL_PLUGINS_GROUP


def test_load_endpoint_plugins_without_tasks_loads_only_plugins_needing_none(endpoints):
    loaded = load_endpoint_plugins()
    assert [p.name for p in loaded] == ["anywhere-plugin"]
    assert load_report().get(ENDPOINT_PLUGINS_GROUP, "gen").outcome == "skipped-tasks"


@pytest.mark.parametrize("tasks", [("generate",), ["generate", "embed"]])
def test_load_endpoint_plugins_gives_the_entry_point_name_with_each_plugin(endpoints, tasks):
    loaded = load_endpoint_plugins(tasks)
    assert [(p.entry_name, p.plugin.name) for p in loaded] == [
        ("anywhere", "anywhere-plugin"), ("gen", "gen-plugin")]
    # Still an EndpointPlugin, so code written for vLLM's list of plugins runs unchanged.
    assert all(isinstance(p, EndpointPlugin) for p in loaded)
    assert [p.required_tasks for p in loaded] == [None, ("generate",)]


def _messages(caplog, level):
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_a_non_default_group_logs_vllms_lines_at_info(stat_group, caplog):
    with caplog.at_level(logging.DEBUG, logger="gateway"):
        loaded = load_plugins_by_group(STAT_LOGGER_PLUGINS_GROUP)
    assert list(loaded) == ["first"]
    info = _messages(caplog, logging.INFO)
    assert info[:4] == [f"Available plugins for group {STAT_LOGGER_PLUGINS_GROUP}:",
                        "- first -> api_group:func", "- broken -> api_missing:func",
                        "All plugins in this group will be loaded. Set `VLLM_PLUGINS` to "
                        "control which plugins to load."]
    [failure] = [r for r in caplog.records if r.getMessage().startswith("Failed to load plugin")]
    assert failure.getMessage().startswith("Failed to load plugin broken ")
    assert failure.levelno == logging.ERROR and failure.exc_info is not None  # the traceback


def test_the_general_group_logs_the_same_lines_at_debug(stat_group, caplog):
    with caplog.at_level(logging.DEBUG, logger="gateway"):
        load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    debug = _messages(caplog, logging.DEBUG)
    assert f"Available plugins for group {DEFAULT_PLUGINS_GROUP}:" in debug
    assert "- gen_one -> api_group:func" in debug
    assert not [m for m in _messages(caplog, logging.INFO) if "Available plugins" in m]


def test_with_an_allowlist_each_allowed_plugin_logs_loading_plugin(stat_group, monkeypatch,
                                                                   caplog):
    monkeypatch.setenv("VLLM_PLUGINS", "first")
    with caplog.at_level(logging.INFO, logger="gateway"):
        load_plugins_by_group(STAT_LOGGER_PLUGINS_GROUP)
    info = _messages(caplog, logging.INFO)
    assert "Loading plugin first" in info
    assert "Loading plugin broken" not in info
    assert not [m for m in info if m.startswith("All plugins in this group")]


def test_spaces_around_an_allowlisted_name_are_stripped_and_the_log_says_so(stat_group,
                                                                            monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", " first ,gen_one")
    assert list(load_plugins_by_group(STAT_LOGGER_PLUGINS_GROUP)) == ["first"]
    [line] = [w for w in allowlist_warnings() if "spaces" in w]
    assert "' first '" in line and "Differences from vLLM" in line


@pytest.mark.parametrize("before", [None, "0"])
def test_logits_processors_import_with_cuda_hidden_and_the_value_comes_back(site, monkeypatch,
                                                                           before):
    write_dist(site, "cuda-probe", {LOGITS_PROCESSORS_GROUP: {"probe": "cuda_probe:Probe"}},
               {"cuda_probe": CUDA_PROBE})
    activate(site, monkeypatch)
    monkeypatch.setenv("CUDA_PROBE", str(site / "seen"))
    if before is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", before)
    try:
        [cls] = load_logits_processor_classes()
    finally:
        forget_modules("cuda_probe")
    assert cls.__name__ == "Probe"
    assert (site / "seen").read_text() == "''"
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before


@pytest.mark.parametrize("name", ["SamplingParams", "PoolingParams", "RequestOutput",
                                  "PoolingRequestOutput", "SchedulerStats", "IterationStats",
                                  "EngineClient", "EndpointPlugin", "StatLoggerBase",
                                  "IOProcessor", "LogitsProcessor", "BatchUpdate"])
def test_the_types_a_plugin_touches_import_from_gateway_plugins(name):
    assert isinstance(getattr(plugins, name), type)
    assert name in plugins.__all__


def test_the_real_engine_client_meets_the_engine_client_protocol():
    from gateway.frontend.engine_client.client import AsyncEngineClient as RealClient
    from gateway.plugins.contracts import EngineClient
    members = {"generate", "encode", "abort", "model_config", "tokenizer", "supported_tasks",
               "model_name", "max_model_len", "config"}
    declared = set(vars(EngineClient)) | set(EngineClient.__annotations__)
    assert members <= declared
    for member in ("generate", "encode", "abort", "model_config"):
        assert callable(getattr(RealClient, member, None)) or isinstance(
            getattr(RealClient, member, None), property), member


def test_gateway_ships_a_py_typed_marker():
    from importlib.resources import files

    import gateway
    assert files(gateway).joinpath("py.typed").is_file()


def test_importing_gateway_plugins_does_not_import_the_engine_or_torch():
    proc = run_python("import sys, gateway.plugins, gateway.platforms\n"
                      "print(sorted(m for m in sys.modules if m == 'torch' or "
                      "m.startswith('gateway.engine')))\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_logits_group_does_not_suggest_vllm_plugins_which_does_not_filter_it(site,
                                                                                monkeypatch,
                                                                                caplog):
    write_dist(site, "lp-hint", {LOGITS_PROCESSORS_GROUP: {"probe": "cuda_probe:Probe"}},
               {"cuda_probe": CUDA_PROBE})
    activate(site, monkeypatch)
    monkeypatch.setenv("CUDA_PROBE", str(site / "seen"))
    with caplog.at_level(logging.INFO, logger="gateway"):
        try:
            load_plugins_by_group(LOGITS_PROCESSORS_GROUP)
        finally:
            forget_modules("cuda_probe")
    info = _messages(caplog, logging.INFO)
    assert f"Available plugins for group {LOGITS_PROCESSORS_GROUP}:" in info
    assert not [m for m in info if "VLLM_PLUGINS" in m]
