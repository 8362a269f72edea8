"""Write a tiny HF Llama folder (tests/tiny_model.py) as a GGUF file, the way llama.cpp's
converter does: llama.cpp tensor names, Q/K rows permuted for its rotary layout, the
byte-level BPE vocabulary and merges as tokenizer metadata (or a SentencePiece model's
pieces, scores and types, as llama.cpp writes a Llama 2 or Mistral vocabulary)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def gguf_name(hf_name: str) -> str:
    if hf_name in _TOP:
        return _TOP[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_BLOCK[module]}.{kind}"


def write_tiny_gguf(folder: Path, path: Path,
                    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
                    arch: str = "llama", int8_tensors: frozenset[str] = frozenset(), *,
                    sentencepiece: bytes | None = None, chat_template: str | None = None,
                    metadata: dict[str, str | float | int] | None = None) -> Path:
    """`arch`: general.architecture; tensors named in `int8_tensors` (HF names) are written
    as GGUF type I8 (which no loader reads). `sentencepiece`: a SentencePiece model (its
    serialized proto) whose vocabulary the file carries instead of the folder's byte-level
    one (its size must be the model's). `metadata`: more keys (str, float32 or uint32)."""
    config = json.loads((folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(config.get("rope_theta")
                                    or config.get("rope_parameters", {}).get("rope_theta")))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if sentencepiece is None:
        _add_tokenizer(writer, folder)
    else:
        add_sentencepiece_vocab(writer, sentencepiece)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, array in load_file(str(folder / "model.safetensors")).items():
        array = array.astype(np.float32)
        if ".q_proj." in name:
            array = permute(array, heads)
        elif ".k_proj." in name:
            array = permute(array, kv_heads)
        if name in int8_tensors:
            writer.add_tensor(gguf_name(name), array.astype(np.int8))
        elif qtype != gguf.GGMLQuantizationType.F32 and array.ndim == 2:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, qtype),
                              raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: gguf.GGUFWriter, folder: Path) -> None:
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    special = {t["content"] for t in data["added_tokens"] if t.get("special")}
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)


# SentencePiece piece types -> tokenizer.ggml.token_type (llama.cpp's convert_hf_to_gguf).
_PIECE_TYPES = {1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6}  # normal, unknown, control, user, unused, byte


def add_sentencepiece_vocab(writer: gguf.GGUFWriter, model_proto: bytes, *,
                            add_space_prefix: bool = True) -> None:
    """A SentencePiece model's vocabulary as llama.cpp writes it: no merges, the scores."""
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(model_proto)
    pieces = list(model.pieces)
    ids = {p.piece: i for i, p in enumerate(pieces)}
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([p.piece for p in pieces])
    writer.add_token_scores([p.score for p in pieces])
    writer.add_token_types([_PIECE_TYPES[p.type] for p in pieces])
    writer.add_bos_token_id(ids["<s>"])
    writer.add_eos_token_id(ids["</s>"])
    writer.add_unk_token_id(ids["<unk>"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(add_space_prefix)


def write_vocab_gguf(path: Path, add_vocab: Callable[[gguf.GGUFWriter], None], *,
                     chat_template: str | None = None) -> Path:
    """A GGUF holding only tokenizer metadata (and one small tensor): enough for tokenizers."""
    writer = gguf.GGUFWriter(str(path), "llama")
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
