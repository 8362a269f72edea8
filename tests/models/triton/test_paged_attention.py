"""The Triton paged attention equals its torch reference (Triton's interpreter, on the
CPU): mixed batches of decodes and prefill chunks, scattered and shared blocks, block
boundaries, long contexts, grouped-query heads, sliding windows, soft-capping, split-K
decodes and padded rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gateway.models.kernels.triton.paged_attention import decode_segments, paged_attention
from gateway.models.kernels.triton.reference import paged_attention_reference
from tests.models.triton.batches import TOLERANCE, PagedBatch, paged_batch

SENTINEL = 1234.0  # what rows the kernel must leave alone hold


def _compare(batch: PagedBatch, *, window: int | None = None, softcap: float | None = None,
             num_segments: int | None = None) -> torch.Tensor:
    """Runs kernel and reference into sentinel-filled outputs; returns the kernel's."""
    q, meta = batch.q, batch.meta
    head_dim = q.shape[-1]
    out = torch.full_like(q, SENTINEL)
    expected = torch.full_like(q, SENTINEL)
    options = dict(block_size=meta.block_size, scale=head_dim ** -0.5, window=window,
                   softcap=softcap)
    paged_attention(q, batch.kv_cache, out, *batch.attention_args(), **options,
                    num_decode_seqs=meta.num_decode_seqs, max_query_len=meta.max_query_len,
                    max_seq_len=meta.max_seq_len, num_segments=num_segments)
    paged_attention_reference(q, batch.kv_cache, expected, *batch.attention_args(), **options)
    torch.testing.assert_close(out.float(), expected.float(), rtol=0,
                               atol=TOLERANCE[q.dtype])
    return out


MIXED = [(15, 1), (16, 1), (40, 1), (0, 1),  # decodes (and a one-token prompt)
         (0, 17), (16, 16), (33, 9)]  # a fresh prompt, chunks over cached contexts


@pytest.mark.parametrize(("dtype", "num_segments"), [
    (torch.float32, 1), (torch.float16, 4), (torch.bfloat16, 2)])
def test_mixed_batch(dtype: torch.dtype, num_segments: int) -> None:
    _compare(paged_batch(MIXED, dtype=dtype), num_segments=num_segments)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [
    (1, 1, 64), (4, 4, 128), (8, 2, 64), (8, 1, 128), (16, 2, 64), (12, 4, 80)])
def test_grouped_query_heads_and_head_dims(num_heads: int, num_kv_heads: int,
                                           head_dim: int) -> None:
    batch = paged_batch([(20, 1), (3, 1), (5, 20)], num_heads=num_heads,
                        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=torch.float16)
    _compare(batch, num_segments=2)


def test_block_boundaries() -> None:
    """Keys ending just before, at and after a block's end, for decodes and prefills."""
    seqs = [(14, 1), (15, 1), (16, 1), (31, 1), (32, 1), (0, 15), (0, 17), (15, 17), (32, 32)]
    _compare(paged_batch(seqs, num_heads=4), num_segments=2)


@pytest.mark.parametrize("num_segments", [1, 8])
def test_long_contexts(num_segments: int) -> None:
    """A decode 2,000 tokens in and a chunk of 10 after 1,990 cached tokens."""
    _compare(paged_batch([(1999, 1), (1990, 10)], num_heads=4, dtype=torch.float16),
             num_segments=num_segments)


def test_sequences_sharing_prefix_blocks() -> None:
    """Sequences whose first three blocks are the same cache blocks (a prefix-cache hit)."""
    batch = paged_batch([(50, 1), (60, 1), (48, 20), (49, 3)], num_heads=4, shared_blocks=3)
    table = batch.meta.block_table
    assert torch.equal(table[1:, :3], table[:1, :3].expand(3, 3))
    _compare(batch, num_segments=2)


@pytest.mark.parametrize(("window", "num_segments"), [(8, 1), (8, 4), (40, 2)])
def test_sliding_window(window: int, num_segments: int) -> None:
    seqs = [(100, 1), (7, 1), (39, 1), (0, 30), (45, 12)]
    _compare(paged_batch(seqs, num_heads=4, dtype=torch.float16), window=window,
             num_segments=num_segments)


@pytest.mark.parametrize("window", [None, 16])
def test_soft_cap(window: int | None) -> None:
    batch = paged_batch(MIXED, dtype=torch.bfloat16)
    batch.q.mul_(4)  # scores large enough for the cap to matter
    _compare(batch, softcap=5.0, window=window, num_segments=2)


@pytest.mark.parametrize("num_segments", [1, 4])
def test_padded_rows_are_left_alone(num_segments: int) -> None:
    """A decode batch padded as a CUDA graph runs it: sequences with seq_len 0 and tokens
    no sequence owns keep what their output rows held."""
    batch = paged_batch([(30, 1), (5, 1), (80, 1)], num_heads=4, num_seqs_padded=8,
                        num_tokens_padded=8)
    assert batch.meta.num_decode_seqs == 8
    out = _compare(batch, num_segments=num_segments)
    assert bool((out[3:] == SENTINEL).all())


def test_padded_sequences_after_prefills_are_left_alone() -> None:
    batch = paged_batch([(30, 1), (0, 20)], num_heads=4, num_seqs_padded=4,
                        num_tokens_padded=24)
    out = _compare(batch)
    assert bool((out[21:] == SENTINEL).all())


def test_reference_equals_sdpa_on_a_fresh_prompt() -> None:
    """The reference itself: a fresh prompt read back from scattered blocks attends as
    causal SDPA over its own keys does."""
    batch = paged_batch([(0, 40)], num_heads=8, num_kv_heads=2)
    slots = batch.meta.slot_mapping
    key = batch.kv_cache[0][:, slots].unsqueeze(0)  # [1, KV, 40, D]
    value = batch.kv_cache[1][:, slots].unsqueeze(0)
    query = batch.q.transpose(0, 1).unsqueeze(0)  # [1, H, 40, D]
    expected = F.scaled_dot_product_attention(query, key, value, is_causal=True,
                                              enable_gqa=True)[0].transpose(0, 1)
    out = paged_attention_reference(batch.q, batch.kv_cache, torch.empty_like(batch.q),
                                    *batch.attention_args(), block_size=16,
                                    scale=batch.q.shape[-1] ** -0.5)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("num_seqs", "max_seq_len", "expected"), [
    (1, None, 16),  # 8 programs on 132 multiprocessors: split as far as allowed
    (4, None, 16),  # 32 programs: 264 / 32 -> 16
    (16, None, 4),  # 128 programs, just under one each: 264 / 128 -> 4
    (17, None, 1),  # more programs than multiprocessors
    (1, 300, 2),  # 300 keys: two segments of at least 4 tiles of 32
    (1, 64, 1),
])
def test_decode_segments(num_seqs: int, max_seq_len: int | None, expected: int) -> None:
    assert decode_segments(num_seqs, 8, 132, max_seq_len) == expected
