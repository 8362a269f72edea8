"""Rule 8: the IO processor is chosen by --io-processor-plugin or the model config; none
named: the group is not loaded at all; a named one that is missing stops start-up listing
those available."""

from __future__ import annotations

import json

import pytest

from gateway.config import EngineConfig, ModelConfig
from gateway.frontend.io_processor import io_processor_name, make_io_processor
from gateway.plugins import IO_PROCESSOR_PLUGINS_GROUP, IOProcessor, PluginError, load_report
from gateway.plugins.groups import load_io_processor
from tests.plugin_dists import activate, forget_modules, write_dist

GROUP = IO_PROCESSOR_PLUGINS_GROUP

PROCESSORS = """
    import pathlib, os
    from gateway.plugins import IOProcessor
    if os.environ.get("IMPORT_MARKER"):
        pathlib.Path(os.environ["IMPORT_MARKER"]).write_text("imported")

    class Echo(IOProcessor):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config)
            self.model = config.model.model
        def parse_data(self, data):
            return data
        def pre_process(self, prompt, request_id=None, **kwargs):
            return prompt
        def post_process(self, model_output, request_id=None, **kwargs):
            return len(model_output)

    class Exploding(Echo):
        def __init__(self, config, *args, **kwargs):
            raise RuntimeError("no GPU for me")

    def echo():
        return "io_procs.Echo"
    def echo_colon():
        return "io_procs:Echo"
    def inactive():
        return None
    def not_a_processor():
        return "io_procs.os"
    def exploding():
        return "io_procs.Exploding"
    def raising():
        raise RuntimeError("register failed")
"""

NAMES = ("echo", "echo_colon", "inactive", "not_a_processor", "exploding", "raising")


@pytest.fixture
def processors(site, monkeypatch):
    write_dist(site, "io-procs", {GROUP: {n: f"io_procs:{n}" for n in NAMES}},
               {"io_procs": PROCESSORS})
    activate(site, monkeypatch)
    yield site
    forget_modules("io_procs")


def test_none_named_the_group_is_not_even_imported(processors, tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    monkeypatch.setenv("IMPORT_MARKER", str(marker))
    assert load_io_processor(None) is None
    assert make_io_processor(EngineConfig()) is None
    assert not marker.exists()
    records = load_report().records(GROUP)
    assert records and {r.outcome for r in records} == {"not-requested"}


@pytest.mark.parametrize("name", ["echo", "echo_colon"])
def test_a_named_processor_is_loaded_checked_and_recorded(processors, name):
    cls = load_io_processor(name)
    assert issubclass(cls, IOProcessor) and cls.__name__ == "Echo"
    [selected] = [r for r in load_report().records(GROUP) if r.outcome == "selected"]
    assert selected.name == name and selected.detail == "io_procs.Echo"


def test_a_missing_processor_stops_start_up_listing_the_available_ones(processors):
    with pytest.raises(PluginError) as info:
        load_io_processor("nope")
    assert "'nope'" in str(info.value)
    assert "available: echo, echo_colon, exploding, inactive, not_a_processor, raising" \
        in str(info.value)


def test_a_processor_the_allowlist_excludes_counts_as_missing(processors, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "echo_colon")
    with pytest.raises(PluginError, match="'echo'.*available: echo_colon$"):
        load_io_processor("echo")


@pytest.mark.parametrize("name, words", [
    ("inactive", "is inactive"),
    ("not_a_processor", "not a subclass of gateway.plugins.IOProcessor"),
    ("raising", "RuntimeError: register failed"),
])
def test_a_named_processor_that_cannot_serve_stops_start_up(processors, name, words):
    with pytest.raises(PluginError, match=words) as info:
        load_io_processor(name)
    assert f"plugin {name!r} (group {GROUP}, distribution io-procs)" in str(info.value)


def test_the_processor_is_made_with_the_engine_config(processors):
    processor = make_io_processor(EngineConfig(model=ModelConfig(model="m.gguf",
                                                                 io_processor_plugin="echo")))
    assert processor.model == "m.gguf"


def test_a_processor_whose_constructor_raises_stops_start_up_and_is_recorded(processors):
    config = EngineConfig(model=ModelConfig(io_processor_plugin="exploding"))
    with pytest.raises(PluginError, match="'exploding'.*no GPU for me"):
        make_io_processor(config)
    assert [r.outcome for r in load_report().records(GROUP) if r.name == "exploding"][-1] == \
        "init-failed"


def test_the_model_config_names_the_processor_when_the_flag_does_not(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "vocab_size": 16, "io_processor_plugin": "from_config"}))
    assert io_processor_name(EngineConfig(model=ModelConfig(model=str(model)))) == "from_config"
    flag = EngineConfig(model=ModelConfig(model=str(model), io_processor_plugin="from_flag"))
    assert io_processor_name(flag) == "from_flag"
