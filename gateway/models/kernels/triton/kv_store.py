"""The KV-cache store in Triton (worker process): this step's K and V rows written into the
paged cache at their slots, one program per token.

The cache of one layer is [2, KV, num_slots, D] (slot = block * block_size + offset); a
step's K/V are [N, 2 KV, D] (each token's K heads, then its V heads, as the QKV projection
lays them out). A negative slot marks a padded token (CUDA-graph padding): it writes
nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    kv_ptr, cache_ptr, slot_mapping_ptr,
    kv_stride_token, kv_stride_head,
    cache_stride_plane, cache_stride_head, cache_stride_slot,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROWS_PADDED: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    rows = tl.arange(0, ROWS_PADDED)  # the token's 2 KV head rows: K heads, then V heads
    dims = tl.arange(0, HEAD_DIM_PADDED)
    mask = (rows < 2 * NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    source = kv_ptr + token.to(tl.int64) * kv_stride_token + rows[:, None] * kv_stride_head
    values = tl.load(source + dims[None, :], mask=mask)
    plane = (rows // NUM_KV_HEADS).to(tl.int64)  # 0: K, 1: V
    head = (rows % NUM_KV_HEADS).to(tl.int64)
    target = (cache_ptr + plane[:, None] * cache_stride_plane + head[:, None] * cache_stride_head
              + slot * cache_stride_slot)
    tl.store(target + dims[None, :], values, mask=mask)


def store_kv(kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write kv [N, 2 KV, D] into kv_cache [2, KV, num_slots, D] at slot_mapping [N] (int32
    or int64; negative: skip the token). kv may be a view with strided tokens and heads."""
    num_tokens, num_rows, head_dim = kv.shape
    if num_tokens == 0:
        return
    if kv.stride(2) != 1 or kv_cache.stride(3) != 1:
        raise ValueError("store_kv needs the head dimension contiguous in kv and kv_cache")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"store_kv: {slot_mapping.shape[0]} slots for {num_tokens} tokens")
    _store_kv_kernel[(num_tokens,)](
        kv, kv_cache, slot_mapping,
        kv.stride(0), kv.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        NUM_KV_HEADS=num_rows // 2, HEAD_DIM=head_dim,
        ROWS_PADDED=triton.next_power_of_2(num_rows),
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        num_warps=1 if num_rows * head_dim <= 1024 else 4,
    )
