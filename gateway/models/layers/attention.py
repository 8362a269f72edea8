"""Paged attention over a flattened batch, in the worker's models: many sequences, prefill
and decode mixed.

The KV cache of one layer is one tensor [2, num_kv_heads, num_slots, head_dim] (slot =
block * block_size + offset): kv-head-major, so gathering a sequence's blocks yields
[num_kv_heads, tokens, head_dim] with no further copy. Writes and gathers go through the
cache's flat views with row indices the model runner computes once per step. The model runner
orders a step's tokens as: single-token queries first (decodes, one per sequence), then prefill
chunks.
`AttentionMetadata` is built once per step and read by every layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from gateway.models.kernels.cpu import attention as cpu_attention
from gateway.models.layers.triton_attention import TritonAttentionMetadata, triton_paged_attention

# Decode attention: from this many sequences up, two matmuls beat SDPA's CPU kernel;
# below it SDPA is faster.
MIN_SEQS_FOR_MATMUL_DECODE = 4
# A lone decode's attention on a CPU runs on one thread up to this context: it is a few
# hundred thousand multiply-adds, less than what waking a second OpenMP thread costs when
# the front end holds the other core (docs/cpu-performance.md).
MAX_SINGLE_THREAD_DECODE_CONTEXT = 4096


def bucket(size: int, exact_up_to: int = 4) -> int:
    """`size` rounded up to one of 4 sizes per power of two above `exact_up_to` (at most
    25% more): the batch and context sizes the decode attention runs at.

    The batched matmuls keep state per shape (oneDNN's and the allocator's caches), and
    continuous batching presents a new (sequences, blocks) pair almost every step: run at
    every exact size, memory grew for as long as new pairs came. Bucketed, a server sees
    at most a few hundred pairs, reused from then on."""
    if size <= exact_up_to:
        return size
    step = 1 << max(0, size.bit_length() - 3)
    return -(-size // step) * step


@dataclass
class PrefillGroup:
    """Back-to-back prefill chunks of `num_seqs` sequences, each `query_len` tokens long.

    Fresh prompts (nothing cached before the chunk) of equal length share one group and
    attend to their own keys only. A chunk that continues a cached context (chunked
    prefill, recompute after preemption) is a group of one that reads its whole context
    back from the cache through `gather_index`.
    """

    start: int  # index of the first token in the flattened batch
    num_seqs: int
    query_len: int
    context_len: int = 0  # tokens cached before this chunk (0: fresh)
    gather_index: torch.Tensor | None = None  # cache rows of its blocks (gather_index)
    mask: torch.Tensor | None = None  # [query_len, context_len + query_len] bool, with context


@dataclass
class AttentionMetadata:
    # Rows of the cache's flat view [2 * KV * num_slots, D] this step's K/V go to
    # (write_index): each token in order, its K heads then its V heads.
    write_index: torch.Tensor  # [num_tokens * 2 * KV] int64
    block_size: int
    num_decode_tokens: int = 0  # tokens [0, num_decode_tokens): one query per sequence
    # The decode attention runs at `decode_batch` sequences (num_decode_tokens, or a bucket
    # above it: the extra rows attend to block 0 and are dropped) and `decode_blocks`
    # blocks each (the longest context's, bucketed).
    decode_batch: int = 0
    # Cache rows to gather (gather_index) for the decodes' blocks, decode_blocks each
    # (padding rows included); None when `decode_slot_start` is set.
    decode_gather_index: torch.Tensor | None = None  # [2 * KV * decode_batch * blocks]
    # A lone decode whose blocks follow each other in the cache reads its keys in place
    # from this slot on: no gather at all.
    decode_slot_start: int | None = None
    # A lone decode's cache blocks, in order (its context's slots, block by block).
    decode_block_ids: np.ndarray | None = None
    # 0 where a decode may attend, -inf on padding; model dtype. None for a lone decode
    # (its keys are cut at its length instead).
    decode_bias: torch.Tensor | None = None  # [1, decode_batch, 1, blocks * block_size]
    decode_context_len: int = 0  # the longest decode context (its tokens, this one included)
    # Where the layers gather the decodes' K/V, one after another: reusing it keeps the
    # copy in cache (a fresh buffer per layer costs more). The runner passes a view of one
    # buffer it keeps across steps.
    decode_gather_buffer: torch.Tensor | None = None
    # Two or more decodes on a CPU: their block tables [B, blocks] and context lengths [B]
    # (int32), which the gateway's C kernel reads the cache through in place (nothing is
    # gathered, no mask). None where the torch ops run (a windowed layer, other devices).
    decode_block_table: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    prefills: list[PrefillGroup] = field(default_factory=list)
    # The Triton backend (triton_attention.py): set, it is all a layer reads (the fields
    # above stay empty) and the Triton kernels serve the step.
    triton: TritonAttentionMetadata | None = None


def paged_attention(q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
    """q [N, H, D] and kv [N, 2 KV, D] (each token's K heads, then its V heads) of this
    step's tokens; returns [N, H, D].

    Writes K/V into `kv_cache` [2, KV, num_slots, D] first, then attends.
    """
    if meta.triton is not None:  # the Triton backend: kernels read the block table in place
        return triton_paged_attention(q, kv, kv_cache, meta.triton)
    # One row copy for K and V of every head: [N, 2 KV, D] -> the flat view's rows.
    head_dim = kv.shape[-1]
    kv_cache.view(-1, head_dim).index_copy_(0, meta.write_index, kv.reshape(-1, head_dim))
    parts = []
    if meta.num_decode_tokens:
        parts.append(_decode_attention(q[:meta.num_decode_tokens], kv_cache, meta))
    if meta.prefills:
        num_kv_heads = kv.shape[1] // 2
        k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    for group in meta.prefills:
        end = group.start + group.num_seqs * group.query_len
        if group.gather_index is None:
            parts.append(_fresh_prefill_attention(
                q[group.start:end], k[group.start:end], v[group.start:end], group))
        else:
            parts.append(_context_prefill_attention(q[group.start:end], kv_cache, group,
                                                    meta.block_size))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def write_index(slots: np.ndarray, num_kv_heads: int, num_slots: int) -> np.ndarray:
    """Rows of the flat view [2 * KV * num_slots, D] for tokens at cache `slots` [N], in the
    order of [N, 2 KV, D] (each token: its K heads, then its V heads)."""
    planes = np.arange(2 * num_kv_heads, dtype=np.int64) * num_slots
    return (slots.reshape(-1, 1) + planes[None, :]).reshape(-1)


def gather_index(block_ids: np.ndarray, num_kv_heads: int, num_blocks: int) -> np.ndarray:
    """Rows of the cache's flat view [2 * KV * num_blocks, block_size * D] that hold the
    listed blocks: K then V, each kv head, the blocks in order. One dim-0 index_select on
    the flat view copies whole blocks (dim-2 selects are several times slower on CPU)."""
    planes = np.arange(2 * num_kv_heads, dtype=np.int64) * num_blocks
    return (planes[:, None] + block_ids.reshape(1, -1)).reshape(-1)


def _gather(kv_cache: torch.Tensor, index: torch.Tensor, block_size: int,
            out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks `index` names (see gather_index), each [KV, tokens, D]."""
    num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[3]
    rows = kv_cache.view(-1, block_size * head_dim)
    gathered = torch.index_select(rows, 0, index, out=out) if out is not None else \
        rows.index_select(0, index)
    gathered = gathered.view(2, num_kv_heads, -1, head_dim)
    return gathered[0], gathered[1]


@contextlib.contextmanager
def on_one_thread() -> Iterator[None]:
    """torch's CPU ops on one thread inside the block; the thread count back after it."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
    if meta.decode_block_table is not None and meta.decode_lens is not None:
        out = cpu_attention.decode_attention(q, kv_cache, meta.decode_block_table,
                                             meta.decode_lens, meta.block_size)
        if out is not None:
            return out
    if (q.shape[0] != 1 or q.device.type != "cpu"
            or meta.decode_context_len > MAX_SINGLE_THREAD_DECODE_CONTEXT):
        return _batched_decode_attention(q, kv_cache, meta)
    with on_one_thread():
        return _batched_decode_attention(q, kv_cache, meta)


def _batched_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor,
                              meta: AttentionMetadata) -> torch.Tensor:
    # q [B, H, D] -> [KV, B', G, D]: the G query heads that share one kv head in a row, at
    # the bucketed batch B'.
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, batch = kv_cache.shape[1], meta.decode_batch
    if batch > num_seqs:
        q = F.pad(q, (0, 0, 0, 0, 0, batch - num_seqs))
    q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    if meta.decode_bias is None:  # a lone decode: its keys cut at its length, no mask
        length = meta.decode_context_len
        if meta.decode_slot_start is not None:
            start = meta.decode_slot_start
            key = kv_cache[0, :, start:start + length].unsqueeze(1)  # [KV, 1, T, D] in place
            value = kv_cache[1, :, start:start + length].unsqueeze(1)
        else:
            key, value = _decode_keys(kv_cache, meta, batch, head_dim)
            key, value = key[:, :, :length], value[:, :, :length]
        out = F.scaled_dot_product_attention(q, key, value)
    else:
        key, value = _decode_keys(kv_cache, meta, batch, head_dim)
        if batch < MIN_SEQS_FOR_MATMUL_DECODE:
            out = F.scaled_dot_product_attention(q, key, value, attn_mask=meta.decode_bias)
        else:
            out = _matmul_attention(q, key, value, meta.decode_bias)
    out = out.transpose(0, 1).reshape(batch, num_heads, head_dim)  # [B', H, D]
    return out if batch == num_seqs else out[:num_seqs]


def _decode_keys(kv_cache: torch.Tensor, meta: AttentionMetadata, batch: int,
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decodes' K and V gathered from their blocks, each [KV, B', T', D]."""
    assert meta.decode_gather_index is not None
    key, value = _gather(kv_cache, meta.decode_gather_index, meta.block_size,
                         meta.decode_gather_buffer)
    num_kv_heads = kv_cache.shape[1]
    return (key.view(num_kv_heads, batch, -1, head_dim),
            value.view(num_kv_heads, batch, -1, head_dim))


def _matmul_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      bias: torch.Tensor) -> torch.Tensor:
    """Attention as two batched matmuls, softmax in float32 (as HF's eager attention).

    q [KV, B, G, D], key/value [KV, B, T, D], bias [1, B, 1, T] 0 / -inf -> [KV, B, G, D].
    """
    # Scaling q is exact for power-of-two head dims, and cheaper than scaling the scores.
    q = q * q.shape[-1] ** -0.5
    scores = torch.matmul(q, key.transpose(-1, -2)).add_(bias)  # [KV, B, G, T]
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), value)


def _fresh_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             group: PrefillGroup) -> torch.Tensor:
    # [S * L, H, D] -> [S, H, L, D]: causal attention within each sequence.
    seqs, length = group.num_seqs, group.query_len
    q4 = q.view(seqs, length, q.shape[1], q.shape[2]).transpose(1, 2)
    k4 = k.view(seqs, length, k.shape[1], k.shape[2]).transpose(1, 2)
    v4 = v.view(seqs, length, v.shape[1], v.shape[2]).transpose(1, 2)
    out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).reshape(q.shape)


def _context_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, group: PrefillGroup,
                               block_size: int) -> torch.Tensor:
    # One sequence: q [L, H, D] attends to its cached context plus itself, [KV, C + L, D].
    assert group.gather_index is not None and group.mask is not None
    total = group.context_len + group.query_len
    key, value = _gather(kv_cache, group.gather_index, block_size)
    key, value = key[:, :total].unsqueeze(0), value[:, :total].unsqueeze(0)
    q4 = q.transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
    out = F.scaled_dot_product_attention(q4, key, value, attn_mask=group.mask,
                                         enable_gqa=q.shape[1] != key.shape[1])
    return out[0].transpose(0, 1).contiguous()  # [L, H, D]
