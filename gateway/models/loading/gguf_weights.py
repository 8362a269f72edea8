"""GGUF tensors under HF names (worker process): llama.cpp's names mapped back, Q/K rows
un-permuted.

llama.cpp's converter permutes the rows of attn_q/attn_k so that rotary pairs are
interleaved; HF's layout (rotate_half) keeps the two halves of each head apart. Undoing
the permutation gives exactly the HF checkpoint's layout.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from gateway.models.info.gguf_file import GGUFFile, GGUFTensorInfo
from gateway.models.info.support import GGUF_WEIGHT_ARCHITECTURES
from gateway.models.layers.gguf_quant import QuantWeight

_LLAMA_TOP = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_LLAMA_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Not weights: read into the config instead (see paths.gguf_hf_config).
_CONFIG_TENSORS = frozenset({"rope_freqs.weight"})


def hf_name(gguf_name: str) -> str | None:
    """The HF checkpoint name of a llama-family GGUF tensor (None: not a weight)."""
    if gguf_name in _LLAMA_TOP:
        return _LLAMA_TOP[gguf_name]
    match = _BLOCK.match(gguf_name)
    if match and match.group(2) in _LLAMA_BLOCK:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LLAMA_BLOCK[part]}.{kind}"
    return None


def unpermute_rows(weight: Any, num_heads: int) -> Any:
    """Undo llama.cpp's rotary permutation of attn_q/attn_k rows ([out, in] or [out]) of a
    numpy array or a torch tensor."""
    half = weight.shape[0] // num_heads // 2
    rows = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)


def iter_gguf_weights(gguf: GGUFFile, keep_quantized: bool = False,
                      ) -> Iterator[tuple[str, GGUFTensorInfo, np.ndarray | QuantWeight]]:
    """(HF name, info, float32 array) for each weight, in file order; with `keep_quantized`,
    a QuantWeight instead for the types gguf_quant keeps (Q4_0, Q4_1, Q8_0)."""
    arch = gguf.get("general.architecture")
    if arch not in GGUF_WEIGHT_ARCHITECTURES:
        raise ValueError(f"{gguf.path}: loading GGUF weights of architecture {arch!r} is not "
                         f"supported (supported: {', '.join(GGUF_WEIGHT_ARCHITECTURES)})")
    heads = int(gguf.get(f"{arch}.attention.head_count"))
    kv_heads = int(gguf.get(f"{arch}.attention.head_count_kv", heads))
    for info in gguf.tensors.values():
        name = hf_name(info.name)
        if name is None:
            if info.name not in _CONFIG_TENSORS:
                raise ValueError(f"{gguf.path}: unexpected tensor {info.name!r}")
            continue
        num_heads = (heads if name.endswith(("q_proj.weight", "q_proj.bias")) else
                     kv_heads if name.endswith(("k_proj.weight", "k_proj.bias")) else None)
        quantized = QuantWeight.from_gguf(gguf.raw(info), info.qtype, info.shape) \
            if keep_quantized else None
        if quantized is not None:
            yield name, info, quantized if num_heads is None else quantized.map_rows(
                functools.partial(unpermute_rows, num_heads=num_heads))
            continue
        array = gguf.dequantize(info)
        yield name, info, array if num_heads is None else unpermute_rows(array, num_heads)
