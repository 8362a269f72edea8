"""The KV-cache block pool (engine-core process): reference counts, the LRU free queue, and
the map from a full block's hash to the block that holds it.

A block's hash chains the hash of the block before it, so equal hashes mean an equal
whole prefix, not just equal tokens in one block (vLLM v1's scheme). SHA-256, so one
client cannot craft a prompt whose hash collides with another's and read its KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

BlockHash = bytes


def root_hash(seed: str) -> BlockHash:
    """The "parent" of a request's first block: `seed` names what the KV depends on beyond
    the tokens (the model, its dtype, the block size), so two configurations never share."""
    return hashlib.sha256(b"gateway prefix cache\0" + seed.encode()).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int],
               extra_key: bytes | None = None) -> BlockHash:
    """The hash of one full block: its parent's hash, its tokens and an optional extra key
    (e.g. a LoRA adapter or a cache salt: requests whose KV differs for the same tokens)."""
    digest = hashlib.sha256(parent)
    digest.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        digest.update(b"\0extra\0" + extra_key)
    return digest.digest()


class BlockPool:
    """The engine's KV blocks. A block is in use while some request holds it (`ref_count > 0`);
    one no request holds is *free* and sits in the free queue, oldest release first. A free
    block may still carry a hash (its KV is valid), so a later request with the same prefix
    can take it back (`touch`) without computing it; only when the pool needs room is the
    block at the head of the queue reused and its hash forgotten (eviction, least recently
    used first).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # hash -> the block holding that prefix
        # Free blocks, least recently released first (an OrderedDict: O(1) removal of a
        # cached block taken back from the middle).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def num_free_among(self, block_ids: Iterable[int]) -> int:
        """How many of these blocks are free (taking them back leaves fewer to allocate)."""
        return sum(1 for block_id in block_ids if self.ref_counts[block_id] == 0)

    def touch(self, block_ids: Iterable[int]) -> None:
        """One more holder for each block; a free one leaves the free queue."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_counts[block_id] += 1

    def take(self, num: int) -> list[int]:
        """`num` blocks from the head of the free queue, evicting their cached prefix."""
        if num > len(self.free_queue):
            raise ValueError(f"{num} blocks asked for, {len(self.free_queue)} free")
        taken = []
        for _ in range(num):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            taken.append(block_id)
        return taken

    def release(self, block_ids: Iterable[int]) -> None:
        """One holder less for each block, in this order; those nobody holds join the tail
        of the free queue (so the first released is the first evicted)."""
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        """Record that `block_id` holds the prefix `block_hash` (its KV is computed). When
        another block holds it already, that one stays the cached copy."""
        if block_hash not in self.cached and self.block_hashes[block_id] is None:
            self.cached[block_hash] = block_id
            self.block_hashes[block_id] = block_hash

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hashes[block_id] = None
