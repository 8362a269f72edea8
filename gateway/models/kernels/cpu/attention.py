"""The decode attention of many sequences on the CPU (attention.c), run by the worker's
attention layer when two or more decodes share a step.

Each (sequence, kv head) reads its blocks of the paged KV cache where they lie, with a
running softmax, so the blocks are not gathered into a copy first and no mask is built;
float32 or bfloat16 caches, computed in float32.
"""

from __future__ import annotations

import torch

from gateway.models.kernels.cpu.library import load


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     lens: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """One query per sequence, q [B, H, D], attending to its `lens` [B] tokens in the paged
    `kv_cache` [2, KV, num_slots, D] through its `block_table` [B, blocks] (both int32),
    read in place: [B, H, D], or None where the kernels cannot take it (then the caller
    gathers the blocks and runs torch's ops)."""
    library = load()
    if (library is None or q.dtype not in (torch.float32, torch.bfloat16)
            or kv_cache.dtype != q.dtype or q.device.type != "cpu"
            or not kv_cache.is_contiguous()):
        return None
    batch, heads, dim = q.shape
    if block_table.dtype != torch.int32 or lens.dtype != torch.int32 \
            or block_table.shape[0] != batch or lens.shape != (batch,):
        raise ValueError("block_table [B, blocks] and lens [B] must be int32")
    q = q.contiguous()
    block_table, lens = block_table.contiguous(), lens.contiguous()
    out = torch.empty_like(q)
    status = library.gw_decode_attention(
        q.data_ptr(), kv_cache.data_ptr(), block_table.data_ptr(), lens.data_ptr(), batch,
        heads, kv_cache.shape[1], dim, block_size, kv_cache.shape[2], block_table.shape[1],
        int(q.dtype == torch.bfloat16), out.data_ptr())
    return out if status == 0 else None
