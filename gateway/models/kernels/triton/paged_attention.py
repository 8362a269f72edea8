"""Paged attention in Triton (worker process): a mixed batch of decodes and prefill chunks
attends to its keys where they lie in the paged KV cache, read through the block table.

The batch is flat: sequence s owns query tokens [query_start_loc[s], query_start_loc[s+1])
and `seq_lens[s]` keys (its cached context, then these queries); a query sees the keys at
or before it, within `window` when set. A sequence with seq_len 0 (a padded row) reads and
writes nothing. One program runs a query block (BLOCK_Q tokens of one sequence times the
GROUP query heads of one kv head) over the key tiles it may see, with an online softmax in
float32. Decodes run apart from prefill chunks, at their own block shape, split into
key segments merged by a second kernel (split-K) where programs are too few for the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # scores are kept in log2 units: exp2 is the cheap exponential
MIN_BLOCK_M = 16  # the smallest row count of a tensor-core dot
MAX_PREFILL_BLOCK_M = 128
DECODE_TILE, PREFILL_TILE = 32, 64  # keys per loop step
MAX_SEGMENTS = 16
MIN_TILES_PER_SEGMENT = 4
# Whether the kernels below run in Triton's interpreter (TRITON_INTERPRET=1 when they were
# defined): CPU tests.
INTERPRETED = bool(triton.knobs.runtime.interpret)


@triton.jit
def _find_sequence(query_start_loc_ptr, index, num_seqs, BLOCK_Q: tl.constexpr,
                   BY_BLOCK: tl.constexpr):
    """The sequence that owns `index`: a query block (BY_BLOCK; sequence s's blocks start
    at (query_start_loc[s] - query_start_loc[0]) // BLOCK_Q + s) or a token counted from
    query_start_loc[0]. A binary search over query_start_loc."""
    base = tl.load(query_start_loc_ptr)
    low: tl.int32 = 0
    high = num_seqs
    while low < high:
        middle = (low + high) // 2
        first = tl.load(query_start_loc_ptr + middle) - base
        if BY_BLOCK:
            first = first // BLOCK_Q + middle
        if first <= index:
            low = middle + 1
        else:
            high = middle
    return low - 1


@triton.jit
def _soft_cap(scores, cap):
    # cap * tanh(scores / cap), as 1 - 2 / (e^2x + 1): finite at both ends.
    return cap - 2.0 * cap / (tl.exp(2.0 * scores / cap) + 1.0)


@triton.jit
def _attention_kernel(
    out_ptr, partial_ptr, partial_max_ptr, partial_sum_ptr,
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_seqs, scale, softcap,
    q_stride_token, q_stride_head, out_stride_token, out_stride_head,
    cache_stride_plane, cache_stride_head, cache_stride_slot, block_table_stride,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, SEGMENTS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    q_block, kv_head, segment = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q, True)
    base = tl.load(query_start_loc_ptr)
    first_token = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - first_token
    seq_len = tl.load(seq_lens_ptr + seq)
    first_query = (q_block - (first_token - base) // BLOCK_Q - seq) * BLOCK_Q
    if (seq_len == 0) | (first_query >= query_len):
        return
    context_len = seq_len - query_len

    # Row r: query token first_query + r // GROUP, query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    token = first_query + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (token < query_len)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    token_index = (first_token + token).to(tl.int64)
    q = tl.load(q_ptr + token_index[:, None] * q_stride_token + head[:, None] * q_stride_head
                + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    query_pos = context_len + token  # [BLOCK_M]

    # The key tiles some row may see: up to the block's last query (causal), from the
    # window's start for its first; a segment's share of them when split.
    key_end = context_len + tl.minimum(first_query + BLOCK_Q, query_len)
    tile_start = 0
    if WINDOW > 0:
        tile_start = tl.maximum(context_len + first_query - WINDOW + 1, 0) // TILE
    tile_end = tl.cdiv(key_end, TILE)
    if SEGMENTS > 1:
        per_segment = tl.cdiv(tl.cdiv(seq_len, TILE), SEGMENTS)
        tile_start = tl.maximum(tile_start, segment * per_segment)
        tile_end = tl.minimum(tile_end, (segment + 1) * per_segment)

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)  # log2 units
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)
    offsets = tl.arange(0, TILE)
    keys_ptr = cache_ptr + kv_head.to(tl.int64) * cache_stride_head
    values_ptr = keys_ptr + cache_stride_plane
    table_ptr = block_table_ptr + seq * block_table_stride
    for tile in range(tile_start, tile_end):
        key_pos = tile * TILE + offsets
        key_valid = key_pos < key_end
        block = tl.load(table_ptr + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + key_pos % BLOCK_SIZE
        k = tl.load(keys_ptr + slot[None, :] * cache_stride_slot + dims[:, None],
                    mask=dim_valid[:, None] & key_valid[None, :], other=0.0)  # [D, TILE]
        v = tl.load(values_ptr + slot[:, None] * cache_stride_slot + dims[None, :],
                    mask=key_valid[:, None] & dim_valid[None, :], other=0.0)  # [TILE, D]
        if UPCAST:
            scores = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            scores = tl.dot(q, k)
        if USE_SOFTCAP:
            scores = _soft_cap(scores * scale, softcap) * LOG2E
        else:
            scores = scores * (scale * LOG2E)
        visible = (key_pos[None, :] <= query_pos[:, None]) & row_valid[:, None]
        if WINDOW > 0:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows with no key yet
        p = tl.exp2(scores - shift[:, None])
        alpha = tl.exp2(running_max - shift)
        running_sum = running_sum * alpha + tl.sum(p, 1)
        if UPCAST:
            acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        running_max = new_max

    if SEGMENTS == 1:
        out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        tl.store(out_ptr + token_index[:, None] * out_stride_token
                 + head[:, None] * out_stride_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
    else:  # this segment's share, in rows [token of this launch, head, segment]
        row = ((token_index - base) * NUM_HEADS + head) * SEGMENTS + segment
        tl.store(partial_max_ptr + row, running_max, mask=row_valid)
        tl.store(partial_sum_ptr + row, running_sum, mask=row_valid)
        tl.store(partial_ptr + row[:, None] * HEAD_DIM_PADDED + dims[None, :], acc,
                 mask=row_valid[:, None])


@triton.jit
def _merge_segments_kernel(
    out_ptr, partial_ptr, partial_max_ptr, partial_sum_ptr, seq_lens_ptr,
    query_start_loc_ptr, num_seqs, out_stride_token, out_stride_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    SEGMENTS: tl.constexpr,
):
    index, head = tl.program_id(0), tl.program_id(1)  # a token of the launch, a query head
    seq = _find_sequence(query_start_loc_ptr, index, num_seqs, 1, False)
    token = tl.load(query_start_loc_ptr) + index
    if (token >= tl.load(query_start_loc_ptr + seq + 1)) | (tl.load(seq_lens_ptr + seq) == 0):
        return
    row = (index.to(tl.int64) * NUM_HEADS + head) * SEGMENTS + tl.arange(0, SEGMENTS)
    maxima = tl.load(partial_max_ptr + row)  # -inf: a segment that saw no key
    weights = tl.exp2(maxima - tl.max(maxima, 0))
    total = tl.sum(tl.load(partial_sum_ptr + row) * weights, 0)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    parts = tl.load(partial_ptr + row[:, None] * HEAD_DIM_PADDED + dims[None, :])
    out = tl.sum(parts * weights[:, None], 0) / total
    tl.store(out_ptr + token.to(tl.int64) * out_stride_token + head * out_stride_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, *, block_size: int, scale: float,
                    window: int | None = None, softcap: float | None = None,
                    num_decode_seqs: int = 0, max_query_len: int | None = None,
                    max_seq_len: int | None = None,
                    num_segments: int | None = None) -> torch.Tensor:
    """Attention of q [T, H, D] over kv_cache [2, KV, num_slots, D] into out [T, H, D].

    query_start_loc [B + 1], seq_lens [B] and block_table [B, W] (int32, on q's device)
    describe the B sequences; the first `num_decode_seqs` have at most one query each (the
    model runner puts decodes first). The rest are launch hints known on the host: the
    longest query (picks the prefill block shape; None: T) and context (caps the decode
    split; None: unbounded), and the decode split itself (None: from the device's size).
    A query's position p is `seq_len - query_len +` its index; it sees the keys at or before
    p, or in (p - window, p] when `window` is set (transformers' sliding window). Rows of
    tokens no sequence owns, and of sequences with seq_len 0, are left as they are.
    """
    num_seqs = seq_lens.shape[0]
    num_decode_seqs = min(num_decode_seqs, num_seqs)
    launch = _Launch(q, kv_cache, out, block_size, scale, window, softcap)
    if num_decode_seqs:
        segments = num_segments if num_segments is not None else decode_segments(
            num_decode_seqs, kv_cache.shape[1], _num_multiprocessors(q.device), max_seq_len)
        launch(query_start_loc[:num_decode_seqs + 1], seq_lens[:num_decode_seqs],
               block_table[:num_decode_seqs], num_decode_seqs, max_query_len=1,
               segments=segments)
    if num_decode_seqs < num_seqs:
        launch(query_start_loc[num_decode_seqs:], seq_lens[num_decode_seqs:],
               block_table[num_decode_seqs:], q.shape[0],
               max_query_len=q.shape[0] if max_query_len is None else max_query_len,
               segments=1)
    return out


def decode_segments(num_seqs: int, num_kv_heads: int, num_multiprocessors: int,
                    max_seq_len: int | None = None) -> int:
    """How many segments each decode's keys are split into: enough (sequence, kv head,
    segment) programs for two per multiprocessor, a power of two up to MAX_SEGMENTS, and
    no more than leave each segment MIN_TILES_PER_SEGMENT tiles of the longest context."""
    programs = num_seqs * num_kv_heads
    if programs >= num_multiprocessors:
        return 1
    segments = min(MAX_SEGMENTS, triton.next_power_of_2(-(-2 * num_multiprocessors // programs)))
    if max_seq_len is not None:
        while segments > 1 and segments * MIN_TILES_PER_SEGMENT * DECODE_TILE > max_seq_len:
            segments //= 2
    return segments


def _num_multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # (Triton's interpreter on the CPU: no split unless asked for)
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


class _Launch:
    """The launches of one attention call (a decode part, a prefill part): what they share."""

    def __init__(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                 block_size: int, scale: float, window: int | None,
                 softcap: float | None) -> None:
        if q.stride(2) != 1 or out.stride(2) != 1 or kv_cache.stride(3) != 1:
            raise ValueError("paged_attention needs the head dimension contiguous")
        self.q, self.kv_cache, self.out = q, kv_cache, out
        self.num_heads, self.head_dim = q.shape[1], q.shape[2]
        self.group = self.num_heads // kv_cache.shape[1]
        self.head_dim_padded = max(16, triton.next_power_of_2(self.head_dim))
        self.block_size, self.scale, self.softcap = block_size, scale, softcap
        self.window = window or 0
        # float32 dots in IEEE precision (not TF32); bfloat16 ones in float32 under the
        # interpreter too, whose dot misreads bfloat16 (kept there as uint16).
        self.upcast = q.dtype == torch.float32 or (
            q.dtype == torch.bfloat16 and INTERPRETED)

    def __call__(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 block_table: torch.Tensor, num_tokens: int, max_query_len: int,
                 segments: int) -> None:
        num_seqs, num_kv_heads = seq_lens.shape[0], self.kv_cache.shape[1]
        rows = max(1, max_query_len) * self.group
        block_m = min(max(MIN_BLOCK_M, triton.next_power_of_2(rows)),
                      max(MAX_PREFILL_BLOCK_M, triton.next_power_of_2(self.group)))
        block_q = block_m // self.group
        is_decode = max_query_len <= 1
        grid = (num_tokens // block_q + num_seqs, num_kv_heads, segments)
        partial = partial_max = partial_sum = self.out  # (not read unless split)
        if segments > 1:
            shape = (num_tokens, self.num_heads, segments)
            partial = self.out.new_empty(shape + (self.head_dim_padded,), dtype=torch.float32)
            partial_max = self.out.new_empty(shape, dtype=torch.float32)
            partial_sum = self.out.new_empty(shape, dtype=torch.float32)
        _attention_kernel[grid](
            self.out, partial, partial_max, partial_sum,
            self.q, self.kv_cache, block_table, seq_lens, query_start_loc,
            num_seqs, self.scale, self.softcap or 0.0,
            self.q.stride(0), self.q.stride(1), self.out.stride(0), self.out.stride(1),
            self.kv_cache.stride(0), self.kv_cache.stride(1), self.kv_cache.stride(2),
            block_table.stride(0),
            NUM_HEADS=self.num_heads, GROUP=self.group,
            HEAD_DIM=self.head_dim, HEAD_DIM_PADDED=self.head_dim_padded,
            BLOCK_SIZE=self.block_size, TILE=DECODE_TILE if is_decode else PREFILL_TILE,
            BLOCK_M=block_m, BLOCK_Q=block_q, WINDOW=self.window,
            USE_SOFTCAP=self.softcap is not None, SEGMENTS=segments, UPCAST=self.upcast,
            num_warps=4 if is_decode or block_m <= 64 else 8, num_stages=2,
        )
        if segments > 1:
            _merge_segments_kernel[(num_tokens, self.num_heads)](
                self.out, partial, partial_max, partial_sum, seq_lens, query_start_loc,
                num_seqs, self.out.stride(0), self.out.stride(1),
                NUM_HEADS=self.num_heads, HEAD_DIM=self.head_dim,
                HEAD_DIM_PADDED=self.head_dim_padded, SEGMENTS=segments, num_warps=4,
            )
