"""Conformance: rule 11, the model registry."""

from __future__ import annotations

import logging

import pytest

from gateway.models.info.registry import _ModelRegistry
from tests.conftest import run_python
from tests.plugin_dists import write_dist


class ToyModel:
    pass


class OtherModel:
    pass


def test_register_and_resolve_a_class():
    registry = _ModelRegistry({})
    registry.register_model("ToyForCausalLM", ToyModel)
    assert registry.get_supported_archs() == ["ToyForCausalLM"]
    assert registry.resolve_model_cls(["Nope", "ToyForCausalLM"]) == (ToyModel, "ToyForCausalLM")


def test_second_registration_replaces_the_first_with_a_log_line(caplog):
    registry = _ModelRegistry({})
    registry.register_model("Toy", ToyModel)
    with caplog.at_level(logging.WARNING, logger="gateway"):
        registry.register_model("Toy", OtherModel)
    assert registry.resolve_model_cls("Toy")[0] is OtherModel
    assert "Toy" in caplog.text and "replaced" in caplog.text


def test_unknown_architecture_lists_the_registered_ones():
    registry = _ModelRegistry({"A": ToyModel, "B": OtherModel})
    with pytest.raises(ValueError, match="Registered architectures: A, B"):
        registry.resolve_model_cls(["Missing"])


@pytest.mark.parametrize("bad", ["", None])
def test_bad_architecture_names_are_refused(bad):
    with pytest.raises(ValueError):
        _ModelRegistry({}).register_model(bad, ToyModel)


def test_lazy_string_without_colon_is_refused():
    with pytest.raises(ValueError, match="module:Class"):
        _ModelRegistry({}).register_model("X", "just_a_module")


def test_lazy_entry_is_not_imported_until_resolved(site):
    write_dist(site, "oot-model", {"vllm.general_plugins": {"oot": "oot_reg:register"}},
               {"oot_reg": """
                    def register():
                        from gateway.models import ModelRegistry
                        if not ModelRegistry.is_registered("OotArch"):
                            ModelRegistry.register_model("OotArch", "oot_model:OotModel")
                """,
                "oot_model": "class OotModel:\n    pass\n"})
    code = ("import sys\n"
            "from gateway.plugins import load_general_plugins\n"
            "from gateway.models import ModelRegistry\n"
            "load_general_plugins()\n"
            "assert 'OotArch' in ModelRegistry.get_supported_archs()\n"
            "assert 'oot_model' not in sys.modules, 'imported too early'\n"
            "cls, arch = ModelRegistry.resolve_model_cls(['OotArch'])\n"
            "print(cls.__module__, cls.__name__, 'oot_model' in sys.modules)\n")
    proc = run_python(code, site)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "oot_model OotModel True"


def test_builtin_llama_is_registered():
    from gateway.models import ModelRegistry
    assert "LlamaForCausalLM" in ModelRegistry.get_supported_archs()
