"""GGUF tensors under HF names (worker process): llama.cpp's names mapped back (gguf_layout),
and the Q/K rows of Llama-family files un-permuted.

For llama and mistral, llama.cpp's converter permutes the rows of attn_q/attn_k so that
rotary pairs are interleaved; HF's layout (rotate_half) keeps the two halves of each head
apart. Undoing the permutation gives exactly the HF checkpoint's layout. Qwen, Phi-3 and
Gemma 3 files keep HF's layout (llama.cpp rotates them as HF does); Gemma 3's norm weights
are stored plus one, which is taken off again. Experts (stacked, 3-D) of the types the
kernels keep stay quantized as StackedExperts where asked, else are dequantized.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import numpy as np

from gateway.models.info.gguf_file import GGUFFile, GGUFTensorInfo
from gateway.models.info.gguf_layout import (
    CONFIG_TENSORS,
    MIXTRAL,
    NORM_WEIGHT_OFFSETS,
    PERMUTED_QK_ARCHITECTURES,
    hf_name,
)
from gateway.models.info.support import GGUF_WEIGHT_ARCHITECTURES
from gateway.models.layers.gguf_quant import (
    BLOCK_KEPT_TYPES,
    KeptWeight,
    StackedExperts,
    kept_from_gguf,
)


def unpermute_rows(weight: Any, num_heads: int) -> Any:
    """Undo llama.cpp's rotary permutation of attn_q/attn_k rows ([out, in] or [out]) of a
    numpy array or a torch tensor."""
    half = weight.shape[0] // num_heads // 2
    rows = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)


def iter_gguf_weights(gguf: GGUFFile, keep_quantized: bool = False,
                      ) -> Iterator[tuple[str, GGUFTensorInfo,
                                          np.ndarray | KeptWeight | StackedExperts]]:
    """(HF name, info, float32 array) for each weight, in file order; with `keep_quantized`,
    a QuantWeight or BlockWeight instead for the types gguf_quant keeps (StackedExperts
    for a stack of experts)."""
    arch = gguf.get("general.architecture")
    if arch not in GGUF_WEIGHT_ARCHITECTURES:
        raise ValueError(f"{gguf.path}: loading GGUF weights of architecture {arch!r} is not "
                         f"supported (supported: {', '.join(GGUF_WEIGHT_ARCHITECTURES)})")
    heads = int(gguf.get(f"{arch}.attention.head_count"))
    kv_heads = int(gguf.get(f"{arch}.attention.head_count_kv", heads))
    permuted, norm_offset = arch in PERMUTED_QK_ARCHITECTURES, NORM_WEIGHT_OFFSETS.get(arch)
    family = MIXTRAL if arch == "llama" and gguf.get("llama.expert_count") else arch
    has_blocks = any(info.qtype in BLOCK_KEPT_TYPES for info in gguf.tensors.values())
    for info in gguf.tensors.values():
        name = hf_name(info.name, family)
        if name is None:
            if info.name not in CONFIG_TENSORS:
                raise ValueError(f"{gguf.path}: unexpected tensor {info.name!r}")
            continue
        num_heads = None if not permuted else (
            heads if name.endswith(("q_proj.weight", "q_proj.bias")) else
            kv_heads if name.endswith(("k_proj.weight", "k_proj.bias")) else None)
        offset = norm_offset if info.name.endswith("norm.weight") else None
        stack = StackedExperts.from_gguf(gguf.raw(info), info.qtype, info.shape) \
            if keep_quantized and len(info.shape) == 3 else None
        if stack is not None:
            yield name, info, stack
            continue
        quantized = kept_from_gguf(gguf.raw(info), info.qtype, info.shape, has_blocks) \
            if keep_quantized and offset is None and len(info.shape) == 2 else None
        if quantized is not None:
            yield name, info, quantized if num_heads is None else quantized.map_rows(
                functools.partial(unpermute_rows, num_heads=num_heads))
            continue
        array = gguf.dequantize(info)
        if offset is not None:
            array = array - offset  # a new array: the memory map stays read-only
        yield name, info, array if num_heads is None else unpermute_rows(array, num_heads)
