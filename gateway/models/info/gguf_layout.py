"""How a GGUF file of each decoder family lays out its weights (torch-free, both sides).

llama.cpp's tensor names map back to the HF checkpoint's, and a family's metadata implies
every tensor's shape: the front end compares the file's tensors with that before the engine
starts, so a missing or misshapen tensor stops start-up in one line naming it, and the
worker loads through the same names.
"""

from __future__ import annotations

import re

from gateway.models.info.decoder_config import DecoderConfig
from gateway.models.info.gguf_file import GGUFFile

#: general.architecture of a decoder GGUF -> the HF architecture it is served as.
GGUF_DECODERS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM"}
#: A llama file with experts (llama.expert_count) is Mixtral; its tensors are named so.
MIXTRAL = "mixtral"
#: Families whose attn_q/attn_k rows llama.cpp's converter permutes: their rope in
#: llama.cpp rotates neighbouring pairs, where HF's rotates the two halves of a head.
PERMUTED_QK_ARCHITECTURES = frozenset({"llama", "mistral"})
#: Not weights: read into the config instead (see paths.gguf_hf_config).
CONFIG_TENSORS = frozenset({"rope_freqs.weight"})
#: Tensors of longrope's factors (Phi-3's long-context files), not read from a GGUF yet.
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")

_TOP = {"token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK_PARTS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
# Per family, the parts named otherwise: Phi-3 stores q/k/v as one tensor, and gate and up
# as one (gate first) under ffn_up; Gemma 3's ffn_norm is the norm before the MLP, and it
# has norms after attention and after the MLP too.
# Experts are stored stacked, [experts, rows, columns] (the router as ffn_gate_inp).
_FAMILY_PARTS = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "qwen3moe": {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
                 "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"},
    MIXTRAL: {"ffn_gate_inp": "block_sparse_moe.gate",
              "ffn_gate_exps": "block_sparse_moe.experts.w1",
              "ffn_up_exps": "block_sparse_moe.experts.w3",
              "ffn_down_exps": "block_sparse_moe.experts.w2"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
#: Families whose norm weights llama.cpp stores plus this offset (Gemma's scale by 1 + w).
NORM_WEIGHT_OFFSETS = {"gemma3": 1.0}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF checkpoint name of a tensor of a decoder GGUF of family `arch`
    (general.architecture); None: not one we know."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    match = _BLOCK.match(gguf_name)
    parts = {**_BLOCK_PARTS, **_FAMILY_PARTS.get(arch, {})}
    if match and match.group(2) in parts:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{parts[part]}.{kind}"
    return None


def expected_tensors(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a GGUF of `config` holds, by llama.cpp name, with its shape (numpy
    order: rows first)."""
    hidden, vocab, inner = config.hidden_size, config.vocab_size, config.intermediate_size
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, hidden),
                                          "output_norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["output.weight"] = (vocab, hidden)
    block: dict[str, tuple[int, ...]] = {"attn_norm": (hidden,), "ffn_norm": (hidden,)}
    if config.sandwich_norms:
        block |= {"post_attention_norm": (hidden,), "post_ffw_norm": (hidden,)}
    if config.fused_checkpoint:
        block |= {"attn_qkv": (q_rows + 2 * kv_rows, hidden), "ffn_up": (2 * inner, hidden)}
    else:
        block |= {"attn_q": (q_rows, hidden), "attn_k": (kv_rows, hidden),
                  "attn_v": (kv_rows, hidden), "ffn_gate": (inner, hidden),
                  "ffn_up": (inner, hidden)}
    block |= {"attn_output": (hidden, q_rows), "ffn_down": (hidden, inner)}
    moe = config.moe
    experts: dict[str, tuple[int, ...]] = {} if moe is None else {
        "ffn_gate_inp": (moe.num_experts, hidden),
        "ffn_gate_exps": (moe.num_experts, moe.intermediate_size, hidden),
        "ffn_up_exps": (moe.num_experts, moe.intermediate_size, hidden),
        "ffn_down_exps": (moe.num_experts, hidden, moe.intermediate_size)}
    biases = {"attn_q": config.qkv_bias, "attn_k": config.qkv_bias, "attn_v": config.qkv_bias,
              "attn_output": config.o_bias, "ffn_gate": config.mlp_bias,
              "ffn_up": config.mlp_bias, "ffn_down": config.mlp_bias}
    for layer in range(config.num_hidden_layers):
        for part, shape in block.items():
            if config.is_moe_layer(layer) and part in ("ffn_gate", "ffn_up", "ffn_down"):
                continue  # the experts instead
            shapes[f"blk.{layer}.{part}.weight"] = shape
            if biases.get(part):
                shapes[f"blk.{layer}.{part}.bias"] = shape[:1]
        for part, shape in experts.items() if config.is_moe_layer(layer) else ():
            shapes[f"blk.{layer}.{part}.weight"] = shape
        if config.qk_norm:
            shapes[f"blk.{layer}.attn_q_norm.weight"] = (config.head_dim,)
            shapes[f"blk.{layer}.attn_k_norm.weight"] = (config.head_dim,)
    return shapes


def layout_mismatch(gguf: GGUFFile, config: DecoderConfig) -> str | None:
    """Why `gguf`'s tensors are not those its metadata (read as `config`) implies: the
    first missing, misshapen or unknown tensor, named; None when they all agree."""
    arch = gguf.get("general.architecture")
    expected = expected_tensors(config)
    for name, shape in expected.items():
        info = gguf.tensors.get(name)
        if info is None:
            return f"tensor {name!r} is missing (the {arch}.* metadata implies it)"
        if info.shape != shape:
            return (f"tensor {name!r} has shape {list(info.shape)}, but the {arch}.* "
                    f"metadata implies {list(shape)}")
    for name in gguf.tensors:
        if name not in expected and name not in CONFIG_TENSORS:
            return f"tensor {name!r} is not a weight of a {arch} model"
    return None
