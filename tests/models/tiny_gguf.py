"""Write a tiny HF decoder folder (tests/tiny_model.py: Llama, Qwen2, Qwen3, Phi-3, Gemma 3,
Qwen3-MoE, Mixtral: experts stacked) as a GGUF file,
the way llama.cpp's converter does: llama.cpp tensor names, Q/K rows permuted for its
rotary layout (llama and mistral only), the byte-level BPE vocabulary and merges as
tokenizer metadata (or a SentencePiece model's pieces, scores and types, as llama.cpp
writes a Llama 2 or Mistral vocabulary)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from tests.models.gguf_weights import BLOCK_KEPT, quantize_blocks

_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


# Gemma 3's norms around attention and the MLP, as llama.cpp names them.
_GEMMA3_BLOCK = {**_BLOCK, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}


# A mixture of experts' router and stacked experts, as llama.cpp names them.
_EXPERTS = {"gate": "ffn_gate_inp", "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps",
            "down_proj": "ffn_down_exps", "w1": "ffn_gate_exps", "w3": "ffn_up_exps",
            "w2": "ffn_down_exps"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(?:experts\.(\d+)\.)?"
                     r"(\w+)\.weight$")


def stack_experts(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF tensors with each layer's router and experts (one tensor each) as llama.cpp
    writes them: ffn_gate_inp and the experts stacked in ffn_{gate,up,down}_exps."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, array in arrays.items():
        match = _EXPERT.match(name)
        if match is None or match.group(3) not in _EXPERTS or \
                (match.group(2) is None and match.group(3) != "gate"):
            out[name] = array
            continue
        layer, expert, part = match.groups()
        target = f"blk.{layer}.{_EXPERTS[part]}.weight"
        if expert is None:
            out[target] = array
        else:
            stacks.setdefault(target, {})[int(expert)] = array
    for target, by_expert in stacks.items():
        out[target] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in _TOP or hf_name.startswith("blk."):
        return _TOP.get(hf_name, hf_name)
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{(_GEMMA3_BLOCK if arch == 'gemma3' else _BLOCK)[module]}.{kind}"


def _rope_theta(config: dict) -> float:
    """The (global layers') rope base, from any of transformers' spellings."""
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    return float(config.get("rope_theta") or rope.get("rope_theta"))


def write_tiny_gguf(folder: Path, path: Path,
                    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
                    arch: str = "llama", int8_tensors: frozenset[str] = frozenset(), *,
                    sentencepiece: bytes | None = None, chat_template: str | None = None,
                    pre: str = "default",
                    tensors: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None
                    = None, metadata: dict[str, str | float | int] | None = None,
                    qtype_of: Callable[[str], gguf.GGMLQuantizationType] | None = None) -> Path:
    """`arch`: general.architecture; tensors named in `int8_tensors` (HF names) are written
    as GGUF type I8 (which no loader reads). `sentencepiece`: a SentencePiece model (its
    serialized proto) whose vocabulary the file carries instead of the folder's byte-level
    one (its size must be the model's), else the folder's with `pre` as
    tokenizer.ggml.pre. `tensors` may change the GGUF tensors (by GGUF name) before they
    are written. `metadata`: more keys (str, float32 or uint32). `qtype_of`: each 2-D
    tensor's and stack of experts' type by GGUF name instead of `qtype` (the K-quants and
    Q5_0/Q5_1 quantized by tests/models/gguf_weights.py's own quantizer); without it the
    stacks stay F32."""
    config = json.loads((folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    permuted = arch in ("llama", "mistral")  # llama.cpp rotates neighbouring pairs there
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if arch == "phi3":  # llama.cpp writes the rotary dimensions, and the window when set
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        factor = (config.get("rope_parameters") or {}).get(
            "partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(int(head_dim * factor))
        if config.get("sliding_window"):
            writer.add_sliding_window(config["sliding_window"])
    writer.add_rope_freq_base(_rope_theta(config))
    if arch == "gemma3" and config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if sentencepiece is None:
        _add_tokenizer(writer, folder, pre)
    else:
        add_sentencepiece_vocab(writer, sentencepiece, add_space_prefix=arch != "gemma3",
                                spaces_as_spaces=arch == "gemma3")
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    arrays = {}
    for name, array in stack_experts(load_file(str(folder / "model.safetensors"))).items():
        array = array.astype(np.float32)
        if permuted and ".q_proj." in name:
            array = permute(array, heads)
        elif permuted and ".k_proj." in name:
            array = permute(array, kv_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp stores Gemma's norm weights plus one
        arrays[gguf_name(name, arch)] = array.astype(np.int8) if name in int8_tensors else array
    for name, array in (arrays if tensors is None else tensors(arrays)).items():
        kind = qtype if qtype_of is None or array.ndim == 1 else qtype_of(name)
        if array.dtype == np.int8 or kind == gguf.GGMLQuantizationType.F32 \
                or array.ndim == 1 or (array.ndim == 3 and qtype_of is None):
            writer.add_tensor(name, array)
            continue
        rows = array.reshape(-1, array.shape[-1])  # a stack of experts' rows, one after another
        blocks = quantize_blocks(rows, kind) if kind in BLOCK_KEPT \
            else gguf.quants.quantize(rows, kind)
        writer.add_tensor(name, blocks.reshape(*array.shape[:-1], -1), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: gguf.GGUFWriter, folder: Path, pre: str) -> None:
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    special = {t["content"] for t in data["added_tokens"] if t.get("special")}
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)


# SentencePiece piece types -> tokenizer.ggml.token_type (llama.cpp's convert_hf_to_gguf).
_PIECE_TYPES = {1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6}  # normal, unknown, control, user, unused, byte


def add_sentencepiece_vocab(writer: gguf.GGUFWriter, model_proto: bytes, *,
                            add_space_prefix: bool = True, spaces_as_spaces: bool = False) -> None:
    """A SentencePiece model's vocabulary as llama.cpp writes it: no merges, the scores
    (`spaces_as_spaces`: pieces of two or more spaces spelled with real spaces, as in
    Gemma's files)."""
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(model_proto)
    pieces = list(model.pieces)
    ids = {p.piece: i for i, p in enumerate(pieces)}
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([" " * len(p.piece) if spaces_as_spaces and len(p.piece) > 1
                           and set(p.piece) == {"\u2581"} else p.piece for p in pieces])
    writer.add_token_scores([p.score for p in pieces])
    writer.add_token_types([_PIECE_TYPES[p.type] for p in pieces])
    writer.add_bos_token_id(ids["<s>"])
    writer.add_eos_token_id(ids["</s>"])
    writer.add_unk_token_id(ids["<unk>"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(add_space_prefix)


def write_vocab_gguf(path: Path, add_vocab: Callable[[gguf.GGUFWriter], None], *,
                     chat_template: str | None = None, arch: str = "llama") -> Path:
    """A GGUF holding only tokenizer metadata (and one small tensor): enough for tokenizers."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny vocabulary")
    add_vocab(writer)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
