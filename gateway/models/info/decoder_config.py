"""Decoder configs read from config.json, and the refusals of what they cannot run.

Torch-free: the front end reads a model's config through here before the engine starts, so
a config field that changes the math and is not implemented stops start-up at once, in
one line naming the field and what is supported, before any weight is read. The worker
builds its model from the same `DecoderConfig`, so the two can never disagree.

`DecoderConfig` is every decoder family's config, read by one reader per architecture
below: what differs between families is data in it (models/archs/decoder.py is the one
model they all run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# Fields that make a checkpoint a mixture of experts (any value above 0 or 1 expert).
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
               "num_experts_per_tok")
_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedConfigError(ValueError):
    """A config field the gateway cannot serve; the message names it and what is supported."""


@dataclass
class DecoderConfig:
    """A Llama-shaped decoder, with the options of the other families."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_freq_factors: list[float] | None = None  # llama.cpp's rope_freqs (llama3 GGUFs)
    context_length: int = 0  # the positions served by default (rope_context_length)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # biases on q/k/v (Qwen2) ...
    o_bias: bool = False  # ... and on o_proj (Llama's attention_bias sets both)
    mlp_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each head's D on q and k, before rope (Qwen3, Gemma 3)
    norm_weight_offset: float = 0.0  # Gemma's norms scale by (1 + weight)
    sandwich_norms: bool = False  # Gemma 3: a norm after attention and around the MLP too
    hidden_act: str = "silu"
    embedding_scale: float | None = None  # Gemma: embeddings times sqrt(hidden size)
    attention_scale: float | None = None  # None: head_dim ** -0.5
    rotary_dim: int | None = None  # partial rotary (Phi-3 family); None: the whole head
    layer_windows: tuple[int | None, ...] = ()  # per layer: its sliding window (None: full)
    local_rope_theta: float | None = None  # Gemma 3: the rope base of its sliding layers
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    fused_checkpoint: bool = False  # Phi-3: q/k/v and gate/up are stored fused
    moe: MoEConfig | None = None  # mixture of experts (Qwen3-MoE, Mixtral); None: dense

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers


@dataclass(frozen=True)
class MoEConfig:
    """The expert layers of a mixture of experts: each token's router softmax over all
    experts, its top `top_k` kept (renormalised to sum 1 when `renormalize`), each
    expert a gated MLP of `intermediate_size`. Checkpoints store expert e of layer i as
    model.layers.{i}.{module}.experts.{e}.{gate, up, down}.weight (`projections`), the
    router as model.layers.{i}.{module}.gate.weight."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    dense_layers: frozenset[int] = frozenset()  # layers with a plain MLP instead
    module: str = "mlp"
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

    def checkpoint_names(self, layer: int) -> list[str]:
        """The router's and every expert's tensor names of expert layer `layer`."""
        prefix = f"model.layers.{layer}.{self.module}"
        return [f"{prefix}.gate.weight"] + [
            f"{prefix}.experts.{expert}.{projection}.weight"
            for expert in range(self.num_experts) for projection in self.projections]


# ------------------------------------------------------------------ shared reading
def _rope_dict(config: dict[str, Any]) -> dict[str, Any]:
    """rope_parameters (transformers 5) and rope_scaling (older; it wins where both are
    set, as in transformers) in one dict, its type under "rope_type"."""
    scaling = dict(config.get("rope_scaling") or {})
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    if scaling.get("rope_type") == "su":  # early Phi-3 configs' name for longrope
        scaling["rope_type"] = "longrope"
    return {**(config.get("rope_parameters") or {}), **scaling}


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None)."""
    rope = _rope_dict(config)
    theta = float(rope.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope.pop("partial_rotary_factor", None)
    scaling = _scaling(rope, "rope_scaling")
    return theta, None if scaling is None else _complete_scaling(scaling, config)


def _scaling(rope: dict[str, Any], field: str) -> dict[str, Any] | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedConfigError(f"{field}: rope scaling type {rope_type!r} is not "
                                     f"supported (supported: {', '.join(ROPE_TYPES)})")
    return None if rope_type == "default" else rope


# rope type -> the keys its scaling must have (after _complete_scaling).
_ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                  "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor",
                             "high_freq_factor"),
                  "longrope": ("short_factor", "long_factor")}
# vLLM's keys that transformers does not read (and llama.cpp's, mapped to them by
# info/paths.py), with their neutral values: others are refused, not read either way.
_ROPE_REFUSED = {"alpha": (None, 1, 1.0), "extrapolation_factor": (None, 1, 1.0),
                 "attn_factor": (None, 1, 1.0), "short_mscale": (None,),
                 "long_mscale": (None,)}


def _complete_scaling(scaling: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """`scaling` checked, with what transformers infers written in: the original context
    (dynamic: max_position_embeddings; yarn and longrope: the config's own
    original_max_position_embeddings first, as Phi-3 keeps it outside rope_scaling) and
    longrope's factor (max_position_embeddings / original when unset)."""
    rope_type = scaling["rope_type"]
    for key in _ROPE_REQUIRED[rope_type]:
        if scaling.get(key) is None:
            raise UnsupportedConfigError(f"rope_scaling: rope type {rope_type!r} needs the "
                                         f"field {key!r}")
    for key, neutral in _ROPE_REFUSED.items():
        if scaling.get(key) not in neutral:
            raise UnsupportedConfigError(f"rope_scaling: {key}={scaling[key]!r} is not "
                                         f"supported with rope type {rope_type!r}")
    max_positions = int(config.get("max_position_embeddings", 2048))
    if rope_type == "dynamic":
        scaling["original_max_position_embeddings"] = max_positions
    elif rope_type in ("yarn", "longrope"):
        original = config.get("original_max_position_embeddings") or \
            scaling.get("original_max_position_embeddings") or max_positions
        scaling["original_max_position_embeddings"] = int(original)
    if rope_type == "longrope" and scaling.get("factor") is None:
        scaling["factor"] = max_positions / scaling["original_max_position_embeddings"]
    return scaling


def rope_context_length(config: dict[str, Any]) -> int:
    """The context a model serves by default, as vLLM derives it: max_position_embeddings,
    times the rope factor for "linear" and "dynamic", and original * factor for "yarn"
    (Gemma 3's max_position_embeddings is already the scaled one)."""
    length = int(config.get("max_position_embeddings") or config.get("n_positions") or 2048)
    rope = _rope_dict(config)
    rope_type = rope.get("rope_type", "default")
    if str(config.get("model_type", "")).startswith("gemma3") or \
            rope_type not in ("linear", "dynamic", "yarn") or rope.get("factor") is None:
        return length
    if rope_type == "yarn":
        length = int(config.get("original_max_position_embeddings") or
                     rope.get("original_max_position_embeddings") or length)
    return int(length * float(rope["factor"]))


def _activation(config: dict[str, Any], supported: tuple[str, ...]) -> str:
    field = "hidden_activation" if config.get("hidden_activation") else "hidden_act"
    act = str(config.get(field) or supported[0])
    if act not in supported:
        raise UnsupportedConfigError(f"{field} {act!r} is not supported ({', '.join(supported)})")
    return act


def _llama_fields(config: dict[str, Any]) -> dict[str, Any]:
    heads = int(config["num_attention_heads"])
    theta, scaling = _rope(config)
    return dict(
        vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_hidden_layers=int(config["num_hidden_layers"]), num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_scaling=scaling, rope_freq_factors=config.get("rope_freq_factors"),
        context_length=rope_context_length(config),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        mlp_bias=bool(config.get("mlp_bias", False)))


def _refuse_moe(config: dict[str, Any]) -> None:
    for field in _MOE_FIELDS:
        value = config.get(field)
        if isinstance(value, int) and value > (1 if field == "num_experts_per_tok" else 0):
            raise UnsupportedConfigError(
                f"{field}={value}: mixture-of-experts layers are not supported in this "
                f"dense architecture (the experts are served for Qwen3MoeForCausalLM and "
                f"MixtralForCausalLM)")


def _refuse_set(config: dict[str, Any], *fields: str) -> None:
    for field in fields:
        if config.get(field):
            raise UnsupportedConfigError(f"{field}={config[field]!r} is not supported "
                                         f"(it must be unset or null)")


def _windows(config: dict[str, Any], default_all: bool) -> tuple[int | None, ...]:
    """Each layer's sliding window: `layer_types` when the config lists them, else every
    layer (`default_all`) or none."""
    window = config.get("sliding_window")
    num_layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:
        return (int(window),) * num_layers if window and default_all else ()
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown:
        raise UnsupportedConfigError(f"layer_types {unknown} are not supported "
                                     f"(supported: {', '.join(_LAYER_TYPES)})")
    if len(types) != num_layers:
        raise UnsupportedConfigError(f"layer_types lists {len(types)} layers, but "
                                     f"num_hidden_layers is {num_layers}")
    if "sliding_attention" in types and not window:
        raise UnsupportedConfigError("layer_types has sliding_attention layers but "
                                     "sliding_window is not set")
    size = int(window) if window else None
    return tuple(size if kind == "sliding_attention" else None for kind in types)


def _decoder(config: dict[str, Any], activations: tuple[str, ...] = ("silu",),
             **options: Any) -> DecoderConfig:
    if options.get("moe") is None:
        _refuse_moe(config)
    act = _activation(config, activations)
    decoder = DecoderConfig(**{**_llama_fields(config), "hidden_act": act, **options})
    _check_longrope_factors(decoder)
    return decoder


def _check_longrope_factors(config: DecoderConfig) -> None:
    """longrope's short and long factors: one per rotated pair of dims."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return
    pairs = (config.rotary_dim or config.head_dim) // 2
    for key in ("short_factor", "long_factor"):
        factors = scaling[key]
        if not isinstance(factors, list) or len(factors) != pairs:
            size = len(factors) if isinstance(factors, list) else repr(factors)
            raise UnsupportedConfigError(f"rope_scaling: {key} has {size} values; the rotary "
                                         f"dims need {pairs}")


# ------------------------------------------------------------------ one reader per family
def _llama(config: dict[str, Any]) -> DecoderConfig:
    _refuse_set(config, "sliding_window")
    bias = bool(config.get("attention_bias", False))
    return _decoder(config, qkv_bias=bias, o_bias=bias)


def _mistral(config: dict[str, Any]) -> DecoderConfig:
    return _decoder(config, layer_windows=_windows(config, default_all=True))


def _qwen_windows(config: dict[str, Any]) -> tuple[int | None, ...]:
    """Qwen2/Qwen3: windows only with use_sliding_window, from layer max_window_layers on."""
    if not config.get("use_sliding_window"):
        return ()
    if config.get("layer_types") is not None:
        return _windows(config, default_all=False)
    first = int(config.get("max_window_layers", 0))
    return tuple(int(config["sliding_window"]) if i >= first else None
                 for i in range(int(config["num_hidden_layers"])))


def _qwen2(config: dict[str, Any]) -> DecoderConfig:
    return _decoder(config, qkv_bias=True,
                    layer_windows=_qwen_windows(config))


def _qwen3(config: dict[str, Any]) -> DecoderConfig:
    bias = bool(config.get("attention_bias", False))
    return _decoder(config, qk_norm=True,
                    qkv_bias=bias, o_bias=bias, layer_windows=_qwen_windows(config))


def _experts(config: dict[str, Any], num_experts: int, top_k: int) -> tuple[int, int]:
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise UnsupportedConfigError(f"num_experts_per_tok={top_k} must be between 1 and the "
                                     f"number of experts ({num_experts})")
    return num_experts, top_k


def _qwen3_moe(config: dict[str, Any]) -> DecoderConfig:
    """transformers' Qwen3MoeConfig defaults where config.json leaves a field out; a layer
    is dense when listed in mlp_only_layers or off the decoder_sparse_step. With
    use_sliding_window every layer is windowed (no max_window_layers, as transformers)."""
    num_experts, top_k = _experts(
        config, int(config.get("num_experts") or config.get("num_local_experts") or 128),
        int(config.get("num_experts_per_tok") or 8))
    step = int(config.get("decoder_sparse_step") or 1)
    only_mlp = set(config.get("mlp_only_layers") or ())
    dense = frozenset(i for i in range(int(config["num_hidden_layers"]))
                      if i in only_mlp or (i + 1) % step)
    moe = MoEConfig(num_experts, top_k, int(config.get("moe_intermediate_size") or 768),
                    renormalize=bool(config.get("norm_topk_prob", False)), dense_layers=dense)
    bias = bool(config.get("attention_bias", False))
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    return _decoder(config, qk_norm=True, qkv_bias=bias, o_bias=bias, moe=moe,
                    layer_windows=(int(window),) * int(config["num_hidden_layers"])
                    if window else ())  # every layer's, as transformers windows it


def _mixtral(config: dict[str, Any]) -> DecoderConfig:
    """Every layer's MLP is the experts (intermediate_size each), top-k renormalised."""
    num_experts, top_k = _experts(config, int(config.get("num_local_experts") or 8),
                                  int(config.get("num_experts_per_tok") or 2))
    moe = MoEConfig(num_experts, top_k, int(config["intermediate_size"]), renormalize=True,
                    module="block_sparse_moe", projections=("w1", "w3", "w2"))
    return _decoder(config, layer_windows=_windows(config, default_all=True), moe=moe)


def _gemma3(config: dict[str, Any]) -> DecoderConfig:
    _refuse_set(config, "attn_logit_softcapping", "use_bidirectional_attention")
    config = _gemma3_defaults(config)
    global_rope, local_rope = _gemma3_rope(config)
    bias = bool(config.get("attention_bias", False))
    return _decoder(
        {**config, **global_rope}, ("gelu_pytorch_tanh", "silu"), qk_norm=True,
        norm_weight_offset=1.0, sandwich_norms=True,
        embedding_scale=float(config["hidden_size"]) ** 0.5,
        attention_scale=float(config.get("query_pre_attn_scalar", 256)) ** -0.5,
        qkv_bias=bias, o_bias=bias, layer_windows=_windows(config, default_all=False),
        local_rope_theta=local_rope,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        final_logit_softcapping=config.get("final_logit_softcapping"))


def _gemma3_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """transformers' Gemma3TextConfig defaults for what config.json may leave out."""
    config = {"head_dim": 256, "rms_norm_eps": 1e-6, "sliding_window": 4096, **config}
    if config.get("layer_types") is None:
        pattern = int(config.get("sliding_window_pattern", 6))
        config["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                 for i in range(int(config["num_hidden_layers"]))]
    return config


def _gemma3_rope(config: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """(config keys for the global layers' rope, the local layers' theta). transformers 5
    writes rope_parameters per layer type; older configs rope_theta, rope_local_base_freq
    and rope_scaling (global layers only)."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        if _scaling(dict(local), "rope_parameters.sliding_attention") is not None:
            raise UnsupportedConfigError("rope_parameters.sliding_attention: rope scaling of "
                                         "the sliding layers is not supported (default only)")
        return ({"rope_parameters": {"rope_theta": full.pop("rope_theta", 1_000_000.0), **full}},
                float(local.get("rope_theta", 10_000.0)))
    return ({"rope_parameters": None, "rope_theta": config.get("rope_theta", 1_000_000.0),
             "rope_scaling": config.get("rope_scaling")},
            float(config.get("rope_local_base_freq", 10_000.0)))


def _phi3(config: dict[str, Any]) -> DecoderConfig:
    # transformers' Phi3Config default, which wins over rope_scaling's (as a config.json's)
    config = {"original_max_position_embeddings": 4096, **config}
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    factor = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    window = config.get("sliding_window")
    return _decoder(config, fused_checkpoint=True,
                    rotary_dim=None if factor == 1.0 else int(head_dim * factor),
                    layer_windows=(int(window),) * int(config["num_hidden_layers"])
                    if window else ())


# Architecture (vLLM's name) -> its config reader.
DECODER_READERS: dict[str, Callable[[dict[str, Any]], DecoderConfig]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Gemma3ForCausalLM": _gemma3,
    "Phi3ForCausalLM": _phi3,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "MixtralForCausalLM": _mixtral,
}


def read_decoder_config(architecture: str, config: dict[str, Any]) -> DecoderConfig:
    """The DecoderConfig of `config` (config.json's dict) read as `architecture`; raises
    UnsupportedConfigError naming a field it cannot serve."""
    try:
        return DECODER_READERS[architecture](config)
    except KeyError as exc:  # a required field missing from config.json
        if architecture not in DECODER_READERS:
            raise
        raise UnsupportedConfigError(f"config.json lacks the field {exc.args[0]!r}") from exc
