"""Loading and validating logits processors (docs/plugins.md, logits processors), with real
distributions."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from gateway.config import ModelConfig
from gateway.plugins import LOGITS_PROCESSORS_GROUP, PluginError, load_report, loader
from gateway.sampling_params import InvalidParameterError, SamplingParams
from gateway.worker.logits_processors import load_logits_processor_classes, validate_request
from gateway.worker.sampler import Sampler
from tests.plugin_dists import forget_modules
from tests.worker.lp_fakes import BROKEN_MODULE, FORCE_CLASS, MODULES, install


@pytest.fixture(autouse=True)
def _fresh_plugins() -> Iterator[None]:
    loader.reset_for_tests()
    yield
    loader.reset_for_tests()
    forget_modules(*MODULES)


def _names(classes: list[type]) -> list[str]:
    return [cls.__name__ for cls in classes]


def test_plugin_classes_load_from_the_entry_point_group(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, {"force": FORCE_CLASS})

    classes = load_logits_processor_classes(ModelConfig())

    assert _names(classes) == ["ForceTokenProcessor"]
    assert load_report().get(LOGITS_PROCESSORS_GROUP, "force").outcome == "loaded"


@pytest.mark.parametrize("allowlist", ["some-other-plugin", ""])
def test_vllm_plugins_does_not_filter_logits_processors(tmp_path, monkeypatch, allowlist):
    install(tmp_path, monkeypatch, {"force": FORCE_CLASS})
    monkeypatch.setenv("VLLM_PLUGINS", allowlist)

    assert _names(load_logits_processor_classes(ModelConfig())) == ["ForceTokenProcessor"]


@pytest.mark.parametrize("name", [FORCE_CLASS, "fake_lp_force.ForceTokenProcessor"])
def test_command_line_names_load_as_module_and_class(tmp_path, monkeypatch, name):
    install(tmp_path, monkeypatch)  # the module only, no entry point

    classes = load_logits_processor_classes(ModelConfig(logits_processors=[name]))

    assert _names(classes) == ["ForceTokenProcessor"]
    assert load_report().get(LOGITS_PROCESSORS_GROUP, name).outcome == "loaded"


def test_plugins_come_first_and_a_class_named_twice_loads_once(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, {"force": FORCE_CLASS})
    config = ModelConfig(logits_processors=[f"{BROKEN_MODULE}:CountsCalls", FORCE_CLASS])

    classes = load_logits_processor_classes(config)

    assert _names(classes) == ["ForceTokenProcessor", "CountsCalls"]


def test_plugin_whose_module_fails_to_import_stops_start_up(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, {"force": FORCE_CLASS, "ghost": "fake_lp_missing:Ghost"},
            dist_name="ghost-dist")

    with pytest.raises(PluginError) as info:
        Sampler(ModelConfig(), 16, [0], torch.device("cpu"))

    message = str(info.value)
    for part in ("'ghost'", "ghost-dist", LOGITS_PROCESSORS_GROUP, f"pid {os.getpid()}",
                 "No module named 'fake_lp_missing'"):
        assert part in message
    assert "'force'" not in message
    assert load_report().get(LOGITS_PROCESSORS_GROUP, "ghost").outcome == "import-failed"


def test_command_line_name_that_fails_to_import_stops_start_up():
    config = ModelConfig(logits_processors=["fake_lp_missing:Ghost"])

    with pytest.raises(PluginError, match=r"'fake_lp_missing:Ghost'.*ModuleNotFoundError"):
        load_logits_processor_classes(config)
    assert load_report().get(LOGITS_PROCESSORS_GROUP, "fake_lp_missing:Ghost").outcome == \
        "import-failed"


def test_command_line_name_missing_its_class_stops_start_up(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch)

    with pytest.raises(PluginError, match=r"'fake_lp_force:Nope'.*AttributeError"):
        load_logits_processor_classes(ModelConfig(logits_processors=["fake_lp_force:Nope"]))


def test_command_line_name_without_a_module_is_rejected():
    with pytest.raises(PluginError, match=r"'JustAClass'.*'module:Class'"):
        load_logits_processor_classes(ModelConfig(logits_processors=["JustAClass"]))


def test_plugin_that_is_not_a_logits_processor_raises_type_error(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, {"odd": f"{BROKEN_MODULE}:NotAProcessor"},
            dist_name="odd-dist")

    with pytest.raises(TypeError) as info:
        load_logits_processor_classes(ModelConfig())

    message = str(info.value)
    assert "'odd'" in message and "odd-dist" in message and "NotAProcessor" in message
    assert load_report().get(LOGITS_PROCESSORS_GROUP, "odd").outcome == "invalid-plugin"


def test_command_line_name_that_is_not_a_subclass_raises_type_error(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch)
    name = f"{BROKEN_MODULE}:NotAProcessor"

    with pytest.raises(TypeError, match=f"'{name}'.*not a subclass of"):
        load_logits_processor_classes(ModelConfig(logits_processors=[name]))


def test_processor_whose_constructor_raises_stops_start_up(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch)
    config = ModelConfig(logits_processors=[f"{BROKEN_MODULE}:RaisesInInit"])

    with pytest.raises(PluginError, match=r"RaisesInInit failed to initialise.*OSError"):
        Sampler(config, 16, [0], torch.device("cpu"))


def test_validate_request_turns_a_value_error_into_invalid_parameter(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, {"force": FORCE_CLASS})
    classes = load_logits_processor_classes(ModelConfig())

    with pytest.raises(InvalidParameterError) as info:
        validate_request(classes, SamplingParams(extra_args={"force_token": "seven"}))

    assert info.value.param == "extra_args"
    assert "force_token must be a non-negative integer, got 'seven'" in str(info.value)
    assert "ForceTokenProcessor" in str(info.value)


def test_validate_request_keeps_the_parameter_a_processor_names(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch)
    config = ModelConfig(logits_processors=[f"{BROKEN_MODULE}:StrictParams"])
    classes = load_logits_processor_classes(config)

    with pytest.raises(InvalidParameterError) as info:
        validate_request(classes, SamplingParams(top_k=7))

    assert info.value.param == "top_k"


def test_validate_request_accepts_good_parameters(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, {"force": FORCE_CLASS})
    classes = load_logits_processor_classes(ModelConfig())

    validate_request(classes, SamplingParams(extra_args={"force_token": 3}))
    validate_request(classes, SamplingParams())


def test_validate_request_checks_logit_bias_ids_against_the_vocabulary():
    params = SamplingParams(logit_bias={5: 1.0, 40: -1.0})

    validate_request([], params)  # no vocabulary size: left to the worker
    validate_request([], params, vocab_size=41)
    with pytest.raises(InvalidParameterError, match=r"token id 40.*\[0, 40\)") as info:
        validate_request([], params, vocab_size=40)
    assert info.value.param == "logit_bias"
