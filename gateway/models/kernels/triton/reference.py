"""Plain-torch references of the Triton kernels beside this file (worker process), with the
same signatures: what the tests compare the kernels with, and what runs where a kernel
cannot compile for the device (fallback.py). Written to be obviously right, not fast: one
sequence at a time, its keys gathered through the block table, softmax in float32.
"""

from __future__ import annotations

import torch


def store_kv_reference(kv: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """kv_store.store_kv: kv [N, 2 KV, D] into kv_cache [2, KV, num_slots, D] at
    slot_mapping [N]; negative slots write nothing."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[3]
    rows = kv[valid].reshape(-1, 2, num_kv_heads, head_dim)  # [n, 2, KV, D]
    kv_cache[:, :, slots] = rows.permute(1, 2, 0, 3).to(kv_cache.dtype)


def paged_attention_reference(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                              query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                              block_table: torch.Tensor, *, block_size: int, scale: float,
                              window: int | None = None, softcap: float | None = None,
                              **launch_hints: int | None) -> torch.Tensor:
    """paged_attention.paged_attention (its launch hints change nothing here)."""
    starts, lengths = query_start_loc.tolist(), seq_lens.tolist()
    num_kv_heads = kv_cache.shape[1]
    for seq, seq_len in enumerate(lengths):
        start, end = starts[seq], starts[seq + 1]
        if seq_len == 0 or end == start:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_table[seq, :num_blocks].long()
        slots = (blocks[:, None] * block_size
                 + torch.arange(block_size, device=blocks.device)).reshape(-1)[:seq_len]
        group = q.shape[1] // num_kv_heads
        key = kv_cache[0][:, slots].float().repeat_interleave(group, 0)  # [H, S, D]
        value = kv_cache[1][:, slots].float().repeat_interleave(group, 0)
        query = q[start:end].float().transpose(0, 1)  # [H, L, D]
        scores = query @ key.transpose(1, 2) * scale  # [H, L, S]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        query_pos = seq_len - (end - start) + torch.arange(end - start, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)
        visible = key_pos[None, :] <= query_pos[:, None]
        if window is not None:
            visible &= key_pos[None, :] > query_pos[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ value).transpose(0, 1).to(out.dtype)
    return out
