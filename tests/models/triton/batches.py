"""Random paged batches for the kernel tests: a KV cache filled with noise (so a kernel that
reads a wrong slot gives a wrong answer), each sequence's blocks scattered over it, some
sequences sharing their first blocks (prefix caching), and the step's queries."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gateway.models.layers.triton_attention import TritonAttentionMetadata, build_triton_metadata

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# How far a kernel's output may be from the float32 reference's, by the dtype they share:
# float32 within summation order; half precisions within a unit or two of the last place.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, H, D], on DEVICE as every tensor here
    kv_cache: torch.Tensor  # [2, KV, num_slots, D]
    meta: TritonAttentionMetadata

    def attention_args(self) -> tuple[torch.Tensor, ...]:
        return (self.meta.query_start_loc, self.meta.seq_lens, self.meta.block_table)


def paged_batch(seqs: list[tuple[int, int]], *, num_heads: int = 8, num_kv_heads: int = 2,
                head_dim: int = 64, dtype: torch.dtype = torch.float32, block_size: int = 16,
                shared_blocks: int = 0, num_seqs_padded: int | None = None,
                num_tokens_padded: int | None = None, seed: int = 0) -> PagedBatch:
    """`seqs`: (context_len, query_len) of each sequence, decodes first. With
    `shared_blocks`, every sequence after the first starts with the first's first blocks."""
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    needed = [-(-(context + query) // block_size) for context, query in seqs]
    num_blocks = sum(needed) + 3  # a few never used
    free = list(rng.permutation(num_blocks))
    table = np.zeros((len(seqs), max(needed)), dtype=np.int64)
    for row, count in enumerate(needed):
        shared = min(shared_blocks, count) if row else 0
        table[row, :shared] = table[0, :shared]
        table[row, shared:count] = [free.pop() for _ in range(count - shared)]
    query_lens = np.array([query for _, query in seqs])
    context_lens = np.array([context for context, _ in seqs])
    meta = build_triton_metadata(query_lens, context_lens, table, block_size,
                                 num_seqs_padded=num_seqs_padded,
                                 num_tokens_padded=num_tokens_padded)
    num_tokens = meta.slot_mapping.shape[0]
    q = torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype)
    kv_cache = torch.randn(2, num_kv_heads, num_blocks * block_size, head_dim,
                           generator=generator).to(dtype)
    return PagedBatch(q.to(DEVICE), kv_cache.to(DEVICE), meta.to(DEVICE))
