"""The Triton attention backend (worker process): which backend a worker uses, the metadata
its kernels read, and the call that stores a layer's K/V and attends through them.

On a CUDA device where Triton imports, each layer's `paged_attention` writes its K/V with
the Triton store and attends with the Triton paged kernel, both reading the block table in
place (models/kernels/triton/); anywhere else the torch path of attention.py runs, as
before. GATEWAY_ATTENTION_BACKEND (envs.py) forces either one: `triton` runs the kernels on
any device (the CPU through Triton's interpreter, for the tests). The model runner builds
`TritonAttentionMetadata` once per step for all layers with `build_triton_metadata`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from gateway import envs

if TYPE_CHECKING:
    from gateway.models.kernels.triton.fallback import KernelWithFallback

BACKENDS = ("auto", "torch", "triton")
# vLLM's CUDA-graph batch sizes: 1, 2, 4, then every 8 up to 256, every 16 up to 512.
MAX_GRAPH_BATCH_SIZE = 512


@dataclass
class TritonAttentionMetadata:
    """One step's batch as the Triton kernels read it: B sequences (B' with padding), the
    first `num_decode_seqs` of them with one query each, T tokens (T' with padding)."""

    slot_mapping: torch.Tensor  # [T'] int64: each token's cache slot; -1: a padded token
    query_start_loc: torch.Tensor  # [B' + 1] int32: sequence s owns tokens [qsl[s], qsl[s+1])
    seq_lens: torch.Tensor  # [B'] int32: context + this step's queries; 0: a padded sequence
    block_table: torch.Tensor  # [B', W] int32: each sequence's cache blocks, in order
    block_size: int
    num_decode_seqs: int  # (the host's copies of what the launches depend on)
    max_query_len: int
    max_seq_len: int
    window: int | None = None  # a sliding-window layer's (sliding_window.window_metadata)

    def to(self, device: torch.device) -> TritonAttentionMetadata:
        """The tensors copied to `device` (without waiting for the copies: from pinned
        memory on CUDA, where a pageable source could make the host wait)."""
        if device.type == "cpu":
            return self
        pin = device.type == "cuda"
        return dataclasses.replace(self, **{
            name: (getattr(self, name).pin_memory() if pin else getattr(self, name)).to(
                device, non_blocking=True)
            for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_table")})


def build_triton_metadata(query_lens: np.ndarray, context_lens: np.ndarray,
                          block_table: np.ndarray, block_size: int, *,
                          num_seqs_padded: int | None = None,
                          num_tokens_padded: int | None = None,
                          num_block_columns: int | None = None) -> TritonAttentionMetadata:
    """The metadata (CPU tensors) of sequences with `query_lens` [B] tokens this step after
    `context_lens` [B] cached ones, whose blocks are the rows of `block_table` [B, >= W].

    Padded to `num_seqs_padded` sequences (seq_len 0, no queries) and `num_tokens_padded`
    tokens (slot -1), as a CUDA graph captured at those sizes needs; `num_block_columns`
    (W) defaults to the longest sequence's blocks.
    """
    query_lens = np.asarray(query_lens, dtype=np.int64)
    context_lens = np.asarray(context_lens, dtype=np.int64)
    num_seqs, num_tokens = len(query_lens), int(query_lens.sum())
    seqs, tokens = num_seqs_padded or num_seqs, num_tokens_padded or num_tokens
    if seqs < num_seqs or tokens < num_tokens:
        raise ValueError(f"Padding to {seqs} sequences and {tokens} tokens: the batch has "
                         f"{num_seqs} sequences and {num_tokens} tokens")
    seq_lens = context_lens + query_lens
    max_seq_len = int(seq_lens.max(initial=0))
    columns = num_block_columns or max(1, -(-max_seq_len // block_size))
    query_start_loc = np.full(seqs + 1, num_tokens, dtype=np.int32)
    query_start_loc[0] = 0
    query_start_loc[1:num_seqs + 1] = np.cumsum(query_lens)
    padded_lens = np.zeros(seqs, dtype=np.int32)
    padded_lens[:num_seqs] = seq_lens
    table = np.zeros((seqs, columns), dtype=np.int32)
    used = min(columns, block_table.shape[1]) if num_seqs else 0
    table[:num_seqs, :used] = block_table[:num_seqs, :used]
    all_query_lens = np.zeros(seqs, dtype=np.int64)
    all_query_lens[:num_seqs] = query_lens
    return TritonAttentionMetadata(
        slot_mapping=torch.from_numpy(slot_mapping(query_lens, context_lens, block_table,
                                                   block_size, tokens)),
        query_start_loc=torch.from_numpy(query_start_loc),
        seq_lens=torch.from_numpy(padded_lens),
        block_table=torch.from_numpy(table),
        block_size=block_size,
        num_decode_seqs=int(np.argmax(np.append(all_query_lens, 2) > 1)),  # leading <= 1
        max_query_len=int(query_lens.max(initial=0)),
        max_seq_len=max_seq_len)


def slot_mapping(query_lens: np.ndarray, context_lens: np.ndarray, block_table: np.ndarray,
                 block_size: int, num_tokens_padded: int) -> np.ndarray:
    """[num_tokens_padded] int64: the cache slot of each of this step's tokens (sequence by
    sequence, positions context_len onwards), then -1 for the padding."""
    num_tokens = int(query_lens.sum())
    offsets = np.cumsum(query_lens) - query_lens
    positions = np.arange(num_tokens) - np.repeat(offsets - context_lens, query_lens)
    seqs = np.repeat(np.arange(len(query_lens)), query_lens)
    slots = np.full(num_tokens_padded, -1, dtype=np.int64)
    slots[:num_tokens] = (block_table[seqs, positions // block_size].astype(np.int64)
                          * block_size + positions % block_size)
    return slots


def graph_batch_size(num_seqs: int) -> int | None:
    """The CUDA-graph batch size a decode step of `num_seqs` sequences pads to (vLLM's
    sizes), or None above the largest (such a step runs eagerly)."""
    if num_seqs > MAX_GRAPH_BATCH_SIZE:
        return None
    if num_seqs <= 4:
        return 1 if num_seqs <= 1 else 2 if num_seqs == 2 else 4
    step = 8 if num_seqs <= 256 else 16
    return -(-num_seqs // step) * step


def use_triton_attention(device: torch.device, backend: str | None = None) -> bool:
    """Whether a worker on `device` attends with the Triton kernels: `backend` (default
    GATEWAY_ATTENTION_BACKEND) `triton` forces them, `torch` the torch path, and `auto`
    picks them on a CUDA device where Triton imports."""
    backend = envs.attention_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"Attention backend {backend!r} (GATEWAY_ATTENTION_BACKEND) is not "
                         f"one of {', '.join(BACKENDS)}")
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        if backend == "triton":
            raise RuntimeError("GATEWAY_ATTENTION_BACKEND=triton, but Triton cannot be "
                               "imported in the worker") from None
        return False
    return True


def triton_paged_attention(q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor,
                           meta: TritonAttentionMetadata) -> torch.Tensor:
    """attention.paged_attention with the Triton kernels: q [T, H, D], kv [T, 2 KV, D] ->
    [T, H, D], this step's K/V written into kv_cache [2, KV, num_slots, D] first."""
    store_kv, paged_attention = _kernels()
    store_kv(kv, kv_cache, meta.slot_mapping)
    out = q.new_empty(q.shape)
    return paged_attention(q, kv_cache, out, meta.query_start_loc, meta.seq_lens,
                           meta.block_table, block_size=meta.block_size,
                           scale=q.shape[-1] ** -0.5, window=meta.window,
                           num_decode_seqs=meta.num_decode_seqs,
                           max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len)


@functools.cache
def _kernels() -> tuple[KernelWithFallback[..., None], KernelWithFallback[..., torch.Tensor]]:
    """The store and attention kernels, each with its reference as fallback: one pair per
    process, so a kernel that cannot compile warns once. Imported on first use: machines
    without Triton never import the kernels."""
    from gateway.models.kernels.triton import kv_store, paged_attention, reference
    from gateway.models.kernels.triton.fallback import KernelWithFallback

    return (KernelWithFallback("store_kv", kv_store.store_kv, reference.store_kv_reference),
            KernelWithFallback("paged_attention", paged_attention.paged_attention,
                               reference.paged_attention_reference))
