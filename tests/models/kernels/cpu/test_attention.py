"""The C kernel for many decodes' attention (attention.c), read in place from the paged KV
cache.

Checked against attention computed in float64 from the same cache, and against the torch
path (gather the blocks, two matmuls under a mask) that runs where the kernel cannot.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gateway.models.kernels.cpu.attention import decode_attention
from gateway.models.layers import attention
from gateway.models.layers.attention import AttentionMetadata, gather_index
from gateway.models.layers.sliding_window import window_metadata
from tests.models.kernels.cpu.wide_rows import wide_bf16_rows

pytestmark = pytest.mark.isa  # the CPU's instruction set decides the paths


def _case(lens: list[int], block_size: int, heads: int, kv_heads: int, dim: int,
          dtype: torch.dtype, seed: int = 0):
    generator = np.random.default_rng(seed)
    torch.manual_seed(seed)
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks + 2
    cache = torch.randn(2, kv_heads, num_blocks * block_size, dim).to(dtype)
    table = generator.permutation(num_blocks)[:len(lens) * max_blocks].reshape(len(lens), -1)
    q = torch.randn(len(lens), heads, dim).to(dtype)
    return q, cache, table


def _reference(q: torch.Tensor, cache: torch.Tensor, table: np.ndarray, lens: list[int],
               block_size: int) -> torch.Tensor:
    heads, kv_heads, dim = q.shape[1], cache.shape[1], q.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, length in enumerate(lens):
        slots = torch.tensor([int(table[b, t // block_size]) * block_size + t % block_size
                              for t in range(length)])
        keys, values = cache[0][:, slots].double(), cache[1][:, slots].double()
        for h in range(heads):
            g = h // (heads // kv_heads)
            probs = torch.softmax(keys[g] @ q[b, h].double() * dim ** -0.5, 0)
            out[b, h] = probs @ values[g]
    return out


def _kernel(q, cache, table, lens, block_size):
    return decode_attention(
        q, cache, torch.from_numpy(table.astype(np.int32)),
        torch.tensor(lens, dtype=torch.int32), block_size)


def _paths() -> list[tuple[torch.dtype, bool]]:
    """(dtype, wide) pairs this CPU runs: float32, bfloat16 on AVX2, and bfloat16 on
    AVX-512 where it has AVX512_BF16."""
    with wide_bf16_rows(True) as wide:
        pass
    return [(torch.float32, False), (torch.bfloat16, False)] + \
        ([(torch.bfloat16, True)] if wide else [])


@pytest.mark.parametrize(("lens", "block_size", "heads", "kv_heads", "dim"), [
    ([1, 5, 16, 17, 200, 33], 16, 9, 3, 64),   # partial blocks, one token, several blocks
    ([100, 49, 47, 3], 48, 4, 4, 80),          # blocks not a multiple of the 32-token pass
    ([300, 64], 128, 8, 1, 128),                # 8 query heads on one kv head, long blocks
    ([600, 257, 31], 16, 12, 2, 96),           # 6 heads a kv head, several 256-token chunks
])
def test_kernel_equals_float64_attention(lens, block_size, heads, kv_heads, dim):
    for dtype, wide in _paths():
        q, cache, table = _case(lens, block_size, heads, kv_heads, dim, dtype)
        with wide_bf16_rows(wide):
            out = _kernel(q, cache, table, lens, block_size)
        _check_float64(out, q, cache, table, lens, block_size)


def _check_float64(out, q, cache, table, lens, block_size):
    dtype = q.dtype
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    expected = _reference(q, cache, table, lens, block_size)
    # float32: the kernel's own rounding; bfloat16: the output's rounding (8 bits)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


def test_kernel_equals_the_torch_path_through_paged_attention():
    lens, block_size, heads, kv_heads, dim = [7, 40, 129, 16, 1], 16, 9, 3, 64
    q, cache, table = _case(lens, block_size, heads, kv_heads, dim, torch.float32, seed=3)
    meta = _decode_meta(lens, block_size, table, cache)
    by_kernel = attention._decode_attention(q, cache, meta)
    meta.decode_block_table = meta.decode_lens = None
    by_torch = attention._decode_attention(q, cache, meta)
    torch.testing.assert_close(by_kernel, by_torch, atol=1e-5, rtol=1e-5)


def test_shapes_the_kernel_does_not_take_fall_back():
    lens = [5, 9]
    q, cache, table = _case(lens, 16, 4, 2, 12, torch.float32)  # head_dim not 8 * n
    assert _kernel(q, cache, table, lens, 16) is None
    q, cache, table = _case(lens, 16, 4, 2, 64, torch.float16)  # half floats: torch's ops
    assert _kernel(q, cache, table, lens, 16) is None
    q, cache, table = _case(lens, 16, 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="int32"):
        decode_attention(q, cache, torch.from_numpy(table), torch.tensor(lens, dtype=torch.int32),
                         16)
    assert _kernel(q, cache, table, [5, 0], 16) is None  # an empty context


def test_a_windowed_layer_runs_torch_ops_with_its_window():
    lens, block_size = [40, 20], 16
    q, cache, table = _case(lens, block_size, 4, 2, 64, torch.float32, seed=5)
    meta = _decode_meta(lens, block_size, table, cache)
    positions = torch.tensor(lens) - 1
    windowed = window_metadata(meta, positions, 8, cache)
    assert windowed.decode_block_table is None and meta.decode_block_table is not None
    out = attention._decode_attention(q, cache, windowed)
    # sequence 0 sees its last 8 tokens only: the float64 reference over those
    keep = list(range(32, 40))
    slots = torch.tensor([int(table[0, t // block_size]) * block_size + t % block_size
                          for t in keep])
    keys, values = cache[0][:, slots].double(), cache[1][:, slots].double()
    probs = torch.softmax(keys[0] @ q[0, 0].double() * 64 ** -0.5, 0)
    torch.testing.assert_close(out[0, 0].double(), probs @ values[0], atol=1e-5, rtol=1e-5)


def _decode_meta(lens: list[int], block_size: int, table: np.ndarray,
                 cache: torch.Tensor) -> AttentionMetadata:
    """Decode metadata as the model runner builds it for these sequences (no bucketing)."""
    kv_heads, num_slots = cache.shape[1], cache.shape[2]
    batch, num_blocks = len(lens), table.shape[1]
    meta = AttentionMetadata(write_index=torch.zeros(0, dtype=torch.int64),
                             block_size=block_size, num_decode_tokens=batch,
                             decode_batch=batch, decode_context_len=max(lens))
    meta.decode_gather_index = torch.from_numpy(
        gather_index(table, kv_heads, num_slots // block_size))
    mask = np.arange(num_blocks * block_size)[None, :] < np.array(lens)[:, None]
    meta.decode_bias = torch.from_numpy(
        np.where(mask, np.float32(0.0), np.float32(-np.inf))).view(1, batch, 1, -1)
    meta.decode_block_table = torch.from_numpy(table.astype(np.int32))
    meta.decode_lens = torch.tensor(lens, dtype=torch.int32)
    return meta
