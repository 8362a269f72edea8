"""The KV-cache block pool: which blocks each request holds. Data lives in the worker."""

from __future__ import annotations


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks if self.num_blocks else 0.0

    def blocks_needed(self, num_held: int, num_tokens: int) -> int:
        """Extra blocks to hold `num_tokens` tokens when `num_held` blocks are held."""
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def allocate(self, block_ids: list[int], num_tokens: int) -> list[int] | None:
        """Grow `block_ids` in place to hold `num_tokens`; return the new blocks, or None
        (and change nothing) when too few are free."""
        need = self.blocks_needed(len(block_ids), num_tokens)
        if need > len(self._free):
            return None
        new = [self._free.pop() for _ in range(need)]
        block_ids.extend(new)
        return new

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))
        block_ids.clear()
