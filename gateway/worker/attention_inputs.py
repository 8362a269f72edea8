"""A step's attention metadata on the torch path (worker process): where each token's K
and V go, the decodes' blocks and the prefill groups, built from the persistent batch's
block table and the KV cache's shape. The model runner builds a step's metadata with it;
a draft model's proposer builds its decode steps' with its own (its cache, the target's
block table). The Triton backend has its own (models/layers/triton_attention.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from gateway.models.layers.attention import (
    MIN_SEQS_FOR_MATMUL_DECODE,
    AttentionMetadata,
    PrefillGroup,
    bucket,
    gather_index,
    write_index,
)
from gateway.worker.host_buffers import to_device
from gateway.worker.input_batch import InputBatch


class PrefillItem(Protocol):
    """A request's chunk of a step: its row, first position and token count."""

    row: int
    start: int
    num_tokens: int


class AttentionInputs:
    def __init__(self, batch: InputBatch, block_size: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.batch, self.block_size = batch, block_size
        self.device, self.dtype = device, dtype
        #: The KV cache of one layer ([2, KV, num_slots, D]; None: not allocated yet).
        self.cache: torch.Tensor | None = None
        self._gather_buffer: torch.Tensor | None = None  # see _decode_buffer

    def use_cache(self, cache: torch.Tensor | None) -> None:
        """The cache the metadata indexes (None: released)."""
        self.cache, self._gather_buffer = cache, None

    def metadata(self, slots: np.ndarray) -> AttentionMetadata:
        """Metadata that writes the tokens' K and V to `slots`, in token order."""
        assert self.cache is not None
        num_kv_heads, num_slots = self.cache.shape[1:3]
        return AttentionMetadata(
            write_index=to_device(write_index(slots, num_kv_heads, num_slots), self.device),
            block_size=self.block_size)

    def decodes(self, positions: np.ndarray, rows: np.ndarray) -> AttentionMetadata:
        """A step of one decode token a row: each row's token at its position."""
        block_size = self.block_size
        slots = (self.batch.block_table[rows, positions // block_size] * block_size
                 + positions % block_size)
        meta = self.metadata(slots)
        self.add_decodes(meta, rows, positions + 1)
        return meta

    def add_decodes(self, meta: AttentionMetadata, rows: np.ndarray,
                    context_lens: np.ndarray) -> None:
        """The decodes' blocks, at a bucketed batch and block count (attention.bucket)."""
        num_seqs, block_size = len(rows), self.block_size
        meta.num_decode_tokens = meta.decode_batch = num_seqs
        meta.decode_context_len = int(context_lens.max())
        num_blocks = -(-meta.decode_context_len // block_size)
        if num_seqs == 1:  # exact length, no mask; in place when its blocks are consecutive
            block_ids = self.batch.block_table[rows, :num_blocks]
            meta.decode_block_ids = block_ids[0]
            if num_blocks == 1 or bool((np.diff(block_ids[0]) == 1).all()):
                meta.decode_slot_start = int(block_ids[0, 0]) * block_size
                return
        else:
            num_blocks = min(bucket(num_blocks), self.batch.block_table.shape[1])
            if num_seqs >= MIN_SEQS_FOR_MATMUL_DECODE:
                meta.decode_batch = bucket(num_seqs)
            # Padding rows read block 0 with nothing masked (finite, then dropped).
            block_ids = np.zeros((meta.decode_batch, num_blocks), dtype=np.int64)
            block_ids[:num_seqs] = self.batch.block_table[rows, :num_blocks]
            if self.device.type == "cpu":
                meta.decode_block_table = torch.from_numpy(
                    block_ids[:num_seqs].astype(np.int32))
                meta.decode_lens = torch.from_numpy(context_lens.astype(np.int32))
            lens = np.full(meta.decode_batch, num_blocks * block_size, dtype=np.int64)
            lens[:num_seqs] = context_lens
            mask = np.arange(num_blocks * block_size)[None, :] < lens[:, None]  # [B', T']
            bias = np.where(mask, np.float32(0.0), np.float32(-np.inf))
            meta.decode_bias = to_device(bias, self.device).to(self.dtype).view(
                1, meta.decode_batch, 1, -1)
        index = self._gather_index(block_ids)
        meta.decode_gather_index = to_device(index, self.device)
        meta.decode_gather_buffer = self._decode_buffer(len(index))

    def add_prefills(self, meta: AttentionMetadata, items: Sequence[PrefillItem],
                     first_token: int) -> None:
        """The prefill chunks, from flat token `first_token` on: fresh prompts of equal
        length side by side in one group, each chunk continuing a cached context alone."""
        start = first_token
        for item in items:
            last = meta.prefills[-1] if meta.prefills else None
            if item.start == 0:
                if (last is not None and last.gather_index is None
                        and last.query_len == item.num_tokens):
                    last.num_seqs += 1
                else:
                    meta.prefills.append(PrefillGroup(start, 1, item.num_tokens))
            else:
                meta.prefills.append(self._context_group(item, start))
            start += item.num_tokens

    def _context_group(self, item: PrefillItem, start: int) -> PrefillGroup:
        total = item.start + item.num_tokens
        num_blocks = -(-total // self.block_size)
        block_ids = self.batch.block_table[item.row, :num_blocks]
        query_positions = item.start + np.arange(item.num_tokens)
        mask = np.arange(total)[None, :] <= query_positions[:, None]  # [L, C + L]
        return PrefillGroup(start, 1, item.num_tokens, context_len=item.start,
                            gather_index=to_device(self._gather_index(block_ids), self.device),
                            mask=to_device(mask, self.device))

    def _decode_buffer(self, num_rows: int) -> torch.Tensor:
        """[num_rows, block_size * D]: a view of one buffer kept across steps (grown to the
        largest bucket seen), so steps allocate no gather memory."""
        assert self.cache is not None
        if self._gather_buffer is None or self._gather_buffer.shape[0] < num_rows:
            head_dim = self.cache.shape[-1]
            self._gather_buffer = self.cache.new_empty((num_rows, self.block_size * head_dim))
        return self._gather_buffer[:num_rows]

    def _gather_index(self, block_ids: np.ndarray) -> np.ndarray:
        assert self.cache is not None
        num_kv_heads, num_slots = self.cache.shape[1:3]
        return gather_index(block_ids, num_kv_heads, num_slots // self.block_size)
