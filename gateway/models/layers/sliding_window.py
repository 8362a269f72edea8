"""Sliding-window attention over the paged KV cache, as a change of the step's metadata
(worker process).

A layer with window W lets the query at position p see the keys at (p - W, p]
(transformers' mask). The cache keeps every key, since full-attention layers of the same
model (Gemma 3 alternates them) read them all; only the masks change, so
`window_metadata` derives, once per step and window, metadata in which each query sees
its window, and windowed layers run the same paged attention with it. Steps in which
every query is within W of the start of its sequence are unchanged.
"""

from __future__ import annotations

import dataclasses

import torch

from gateway.models.layers.attention import AttentionMetadata, PrefillGroup


def window_metadata(meta: AttentionMetadata, positions: torch.Tensor, window: int,
                    kv_cache: torch.Tensor) -> AttentionMetadata:
    """`meta` with every query limited to its `window` latest keys; `positions` [N] of the
    step's tokens, `kv_cache` [2, KV, num_slots, D] (any layer's: they share the layout).

    - decodes: positions before the window are -inf in the decode bias (a lone decode, which
      runs without a bias, gets one, and gathers its blocks instead of reading them in place);
    - a chunk continuing a cached context: its boolean mask loses the keys before the window;
    - fresh prompts (attended causally, without a mask): each one longer than the window
      becomes a group of its own that reads its keys back from the cache (written at the
      start of the layer's attention) under a windowed causal mask.
    """
    if meta.triton is not None:  # the Triton kernels take the window as it is
        return dataclasses.replace(meta, triton=dataclasses.replace(meta.triton, window=window))
    windowed = dataclasses.replace(meta, prefills=[])
    if meta.num_decode_tokens and meta.decode_context_len > window:
        _window_decodes(windowed, positions[:meta.num_decode_tokens], window, kv_cache)
    for group in meta.prefills:
        windowed.prefills.extend(_window_prefill(group, meta, window, kv_cache))
    return windowed


def _window_decodes(meta: AttentionMetadata, positions: torch.Tensor, window: int,
                    kv_cache: torch.Tensor) -> None:
    device, block_size = kv_cache.device, meta.block_size
    meta.decode_block_table = meta.decode_lens = None  # the kernel sees no window: torch's ops
    if meta.decode_bias is None:  # one sequence, keys cut at its length
        length = meta.decode_context_len
        num_blocks = -(-length // block_size)
        if meta.decode_slot_start is not None:  # its blocks follow each other in the cache
            first = meta.decode_slot_start // block_size
            meta.decode_gather_index = _block_rows(
                torch.arange(first, first + num_blocks, device=device), kv_cache, block_size)
            meta.decode_slot_start, meta.decode_gather_buffer = None, None
        keys = torch.arange(num_blocks * block_size, device=device)
        visible = (keys < length) & (keys > length - 1 - window)
        meta.decode_bias = _bias(visible, kv_cache.dtype).view(1, 1, 1, -1)
        return
    bias = meta.decode_bias  # [1, B', 1, T']: B' >= the B decodes (padding rows last)
    keys = torch.arange(bias.shape[-1], device=device)
    before = keys[None, :] <= (positions - window)[:, None]  # [B, T']
    padding = before.new_zeros(bias.shape[1] - before.shape[0], before.shape[1])
    meta.decode_bias = bias.masked_fill(torch.cat((before, padding)).view(bias.shape),
                                        float("-inf"))


def _window_prefill(group: PrefillGroup, meta: AttentionMetadata, window: int,
                    kv_cache: torch.Tensor) -> list[PrefillGroup]:
    if group.context_len + group.query_len <= window:
        return [group]
    device = kv_cache.device
    queries = torch.arange(group.query_len, device=device)
    if group.gather_index is not None:  # one sequence, cached context + this chunk
        assert group.mask is not None
        keys = torch.arange(group.context_len + group.query_len, device=device)
        in_window = keys[None, :] > (group.context_len + queries - window)[:, None]
        return [dataclasses.replace(group, mask=group.mask & in_window)]
    mask = ((queries[None, :] <= queries[:, None])
            & (queries[None, :] > queries[:, None] - window))  # [L, L]
    rows_per_token = 2 * kv_cache.shape[1]
    groups = []
    for seq in range(group.num_seqs):
        start = group.start + seq * group.query_len
        # A token's first write row (its K head 0) is its slot; a fresh prompt starts at
        # position 0, so every block_size-th token opens one of its blocks.
        slots = meta.write_index[start * rows_per_token:(start + group.query_len)
                                 * rows_per_token:rows_per_token]
        blocks = slots[::meta.block_size] // meta.block_size
        groups.append(PrefillGroup(start, 1, group.query_len, context_len=0,
                                   gather_index=_block_rows(blocks, kv_cache, meta.block_size),
                                   mask=mask))
    return groups


def _block_rows(block_ids: torch.Tensor, kv_cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """attention.gather_index in torch: the rows of the cache's block view holding the
    blocks, K then V, each kv head."""
    num_planes, num_blocks = 2 * kv_cache.shape[1], kv_cache.shape[2] // block_size
    planes = torch.arange(num_planes, device=block_ids.device) * num_blocks
    return (planes[:, None] + block_ids[None, :]).reshape(-1)


def _bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, float("-inf"))
