"""A model the gateway cannot serve stops `gateway serve` at once, with one line naming the
model, the field and what is supported, before the engine starts or any weight is read:
an architecture that is not registered, a config field that changes the math and is not
implemented (rope scaling kinds, attention soft-capping, mixture of experts, ...), the
multimodal, DeepSeek MLA and gpt-oss architectures (each with its reason), a GGUF file of
another family or with tensors of a type that cannot be read.

The HF folders here hold a config.json and a tokenizer but no weights, so a start that got
as far as reading weights would fail differently. The servers start side by side."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.models.info.decoder_config import UnsupportedConfigError, read_decoder_config
from tests.models.tiny_gguf import write_tiny_gguf
from tests.server import free_port
from tests.tiny_model import build_tiny_llama

pytestmark = pytest.mark.e2e

_MROPE = {"rope_type": "mrope", "mrope_section": [2, 3, 3]}
# case -> (config.json changes, or a GGUF variant; what the line must say)
HF_CASES: dict[str, tuple[dict, list[str]]] = {
    "unregistered-architecture": ({"architectures": ["Gemma2ForCausalLM"]},
                                  ["['Gemma2ForCausalLM'] are not supported",
                                   "Registered architectures: ", "Qwen3ForCausalLM"]),
    "rope-scaling-kind": ({"architectures": ["Qwen2ForCausalLM"], "rope_scaling": _MROPE},
                          ["Qwen2ForCausalLM: rope_scaling: rope scaling type 'mrope' is not "
                           "supported (supported: default, linear, dynamic, yarn, longrope, "
                           "llama3)"]),
    "rope-scaling-incomplete": ({"architectures": ["Phi3ForCausalLM"], "rope_scaling": {
        "rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 8}},
        ["Phi3ForCausalLM: rope_scaling: short_factor has 4 values; the rotary dims need 8"]),
    "multimodal": ({"architectures": ["Qwen2VLForConditionalGeneration"]},
                   ["['Qwen2VLForConditionalGeneration'] are not supported (a multimodal "
                    "architecture: only text models are served)"]),
    "deepseek-mla": ({"architectures": ["DeepseekV3ForCausalLM"]},
                     ["['DeepseekV3ForCausalLM'] are not supported (DeepSeek's multi-head "
                      "latent attention is not implemented)"]),
    "gpt-oss": ({"architectures": ["GptOssForCausalLM"]},
                ["['GptOssForCausalLM'] are not supported (gpt-oss's attention sinks"]),
    "attention-soft-capping": ({"architectures": ["Gemma3ForCausalLM"], "head_dim": 16,
                                "attn_logit_softcapping": 50.0},
                               ["Gemma3ForCausalLM: attn_logit_softcapping=50.0 is not "
                                "supported (it must be unset or null)"]),
    "mixture-of-experts": ({"architectures": ["MistralForCausalLM"], "num_local_experts": 8},
                           ["MistralForCausalLM: num_local_experts=8: mixture-of-experts "
                            "layers are not supported"]),
}
GGUF_CASES: dict[str, tuple[dict, list[str]]] = {
    "gguf-tensor-type": ({"int8_tensors": frozenset({"model.layers.0.mlp.up_proj.weight"})},
                         ["tensor 'blk.0.ffn_up.weight' has GGUF type I8, which cannot be "
                          "read (supported: F32, F16, Q4_0", "Q8_0"]),
    "gguf-architecture": ({"arch": "qwen2"},
                          ["GGUF general.architecture 'qwen2' is not supported (supported: "
                           "llama, mistral"]),
}


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int, str]]:
    """Every case's model, and `gateway serve` on it: (model, exit code, output)."""
    root = tmp_path_factory.mktemp("refused")
    tiny = build_tiny_llama(root / "tiny")
    models = {case: _hf_variant(tiny, root / case, changes)
              for case, (changes, _) in HF_CASES.items()}
    models.update({case: write_tiny_gguf(tiny, root / f"{case}.gguf", **options)
                   for case, (options, _) in GGUF_CASES.items()})
    processes = {case: subprocess.Popen(
        [sys.executable, "-m", "gateway.frontend.cli.main", "serve", str(model),
         "--port", str(free_port())], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for case, model in models.items()}
    results = {}
    for case, process in processes.items():
        output, _ = process.communicate(timeout=120)
        results[case] = (models[case], process.returncode, output)
    return results


def _hf_variant(tiny: Path, folder: Path, changes: dict) -> Path:
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, folder / name)
    config = json.loads((tiny / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


@pytest.mark.parametrize("case", [*HF_CASES, *GGUF_CASES])
def test_serve_refuses_in_one_line_before_any_weight_is_read(started, case: str) -> None:
    model, returncode, output = started[case]
    expected = {**HF_CASES, **GGUF_CASES}[case][1]
    lines = [line for line in output.splitlines() if "Cannot start:" in line]
    assert returncode == 1, output
    assert len(lines) == 1, output
    assert f"Cannot start: Model {model.resolve()} cannot be served: " in lines[0]
    assert all(part in lines[0] for part in expected), lines[0]
    assert "Traceback" not in output and "Engine core" not in output, output


@pytest.mark.parametrize(("architecture", "changes", "field"), [
    ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "dynamic"}},
     "rope_scaling: rope type 'dynamic' needs the field 'factor'"),
    ("Phi3ForCausalLM", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}},
     "rope type 'longrope' needs the field 'long_factor'"),
    ("Qwen2ForCausalLM", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                           "extrapolation_factor": 0.5}},
     "extrapolation_factor=0.5 is not supported with rope type 'yarn'"),
    ("Qwen3ForCausalLM", {"num_experts": 64}, "num_experts=64"),
    ("Gemma3ForCausalLM", {"use_bidirectional_attention": True},
     "use_bidirectional_attention=True"),
    ("Gemma3ForCausalLM", {"hidden_activation": "relu"}, "hidden_activation 'relu'"),
    ("LlamaForCausalLM", {"sliding_window": 4096}, "sliding_window=4096"),
    ("MistralForCausalLM", {"layer_types": ["chunked_attention"] * 2},
     "layer_types ['chunked_attention']"),
])
def test_each_unimplemented_field_is_named(architecture: str, changes: dict, field: str) -> None:
    config = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 2, "num_attention_heads": 2, **changes}
    with pytest.raises(UnsupportedConfigError, match=field.replace("[", r"\[")):
        read_decoder_config(architecture, config)
