"""Weight loading errors: each names what is wrong (path, architecture, tensor, file, dtype)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from gateway.config import EngineConfig, ModelConfig
from gateway.models.info.gguf_file import GGUFError, GGUFFile
from gateway.models.info.paths import read_model_info
from gateway.models.loading import loader
from gateway.models.loading.loader import resolve_dtype
from gateway.platforms.cpu import CpuPlatform
from gateway.platforms.cpu_isa import cpu_isa
from gateway.worker.worker import Worker
from tests.models.tiny_gguf import write_tiny_gguf
from tests.tiny_model import build_tiny_llama

pytestmark = pytest.mark.isa  # the CPU's instruction set decides the paths


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny")


def _copy(folder: Path, target: Path) -> Path:
    target.mkdir()
    for item in folder.iterdir():
        (target / item.name).write_bytes(item.read_bytes())
    return target


def _load(model: str | Path | None, dtype: str = "float32") -> Worker:
    name = None if model is None else str(model)
    worker = Worker(EngineConfig(model=ModelConfig(model=name, dtype=dtype)))
    worker.init_device()
    worker.load_model()
    return worker


def test_missing_model_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere.*does not exist"):
        _load(tmp_path / "nowhere")


def test_unknown_architecture_lists_the_registered_ones(tiny: Path, tmp_path: Path) -> None:
    folder = _copy(tiny, tmp_path / "odd")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"FalconForCausalLM.*not supported.*"
                                         r"Registered architectures:.*LlamaForCausalLM"):
        _load(folder)


def test_a_missing_safetensors_tensor_is_named(tiny: Path, tmp_path: Path) -> None:
    folder = _copy(tiny, tmp_path / "partial")
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"partial lacks tensor "
                                         r"'model.layers.1.self_attn.k_proj.weight'"):
        _load(folder)


def test_a_tensor_of_the_wrong_shape_is_named(tiny: Path, tmp_path: Path) -> None:
    folder = _copy(tiny, tmp_path / "reshaped")
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\)"):
        _load(folder)


def test_a_corrupt_safetensors_file_is_named(tiny: Path, tmp_path: Path) -> None:
    folder = _copy(tiny, tmp_path / "corrupt")
    (folder / "model.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0{broken}")
    with pytest.raises(ValueError, match="model.safetensors"):
        _load(folder)


@pytest.mark.parametrize("keep", [0.5, 0.01], ids=["tensor-data", "header"])
def test_a_truncated_gguf_is_named(tiny: Path, tmp_path: Path, keep: float) -> None:
    path = write_tiny_gguf(tiny, tmp_path / "tiny.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(GGUFError, match="tiny.gguf is truncated"):
        read_model_info(path)


def test_a_file_that_is_not_gguf_inside_is_named(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(path)


def test_quantized_gguf_tensors_are_dequantized(tiny: Path, tmp_path: Path) -> None:
    import gguf

    path = write_tiny_gguf(tiny, tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    reader = GGUFFile(path)
    info = reader.tensors["blk.0.ffn_up.weight"]
    assert info.qtype == gguf.GGMLQuantizationType.Q8_0
    original = load_file(tiny / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]
    restored = torch.from_numpy(reader.dequantize(info).copy())
    assert restored.shape == original.shape
    assert (restored - original).abs().max() < 0.02  # Q8_0 rounding only
    _load(path)  # the whole model loads


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_a_dtype_the_device_cannot_run_is_named(tiny: Path, dtype: str) -> None:
    with pytest.raises(ValueError, match=f"dtype '{dtype}'"):
        _load(tiny, dtype=dtype)


def test_auto_dtype_is_bfloat16_on_cpus_with_native_bf16() -> None:
    expected = torch.bfloat16 if cpu_isa().has_native_bf16 else torch.float32
    assert resolve_dtype("auto", CpuPlatform) == expected


@pytest.mark.parametrize("bf16_products", [True, False])
def test_auto_dtype_is_float32_where_gguf_weights_stay_in_the_float32_kernels(
        tiny: Path, monkeypatch: pytest.MonkeyPatch, bf16_products: bool) -> None:
    """On a CPU with native bf16 (what this test makes every CPU look like), "auto" is
    bfloat16, but float32 for a quantized GGUF whose products the kernels would run in
    float32 anyway (no AVX512-BF16 products, what the parameter makes the CPU look like)."""
    monkeypatch.setattr(loader, "_has_native_bf16", lambda platform: True)
    monkeypatch.setattr(loader.quant_weight, "has_bf16_products", lambda: bf16_products)
    default = read_model_info(None)  # Q4_1 and Q8_0 tensors
    kept = torch.bfloat16 if bf16_products else torch.float32
    assert loader.resolve_model_dtype("auto", CpuPlatform, default) == kept
    assert loader.resolve_model_dtype("auto", CpuPlatform, default, "gguf") == kept
    assert ("AVX512-BF16 kernels" if bf16_products else "float32 kernels") in \
        loader.explain_dtype("auto", CpuPlatform, default)
    # Dequantized, asked for by name, or with no quantized tensor: bfloat16.
    assert loader.resolve_model_dtype("auto", CpuPlatform, default, "none") == torch.bfloat16
    assert loader.resolve_model_dtype("bfloat16", CpuPlatform, default) == torch.bfloat16
    assert loader.resolve_model_dtype("auto", CpuPlatform, read_model_info(str(tiny))) \
        == torch.bfloat16
    dense_gguf = write_tiny_gguf(tiny, tiny.parent / "dense.gguf", gguf.GGMLQuantizationType.F32)
    assert loader.resolve_model_dtype("auto", CpuPlatform, read_model_info(str(dense_gguf))) \
        == torch.bfloat16
    # Without the kernels (GATEWAY_CPU_QUANT_KERNELS=0) the weights are dequantized.
    monkeypatch.setattr(loader.cpu_kernels, "load", lambda: None)
    assert loader.resolve_model_dtype("auto", CpuPlatform, default) == torch.bfloat16


def test_the_default_model_loads_with_progress_lines(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="gateway"):
        worker = _load(None, dtype="bfloat16")
    assert "Loading weights from" in caplog.text and "100%" in caplog.text
    assert worker.vocab_size == 49152 and worker.max_model_len == 8192
