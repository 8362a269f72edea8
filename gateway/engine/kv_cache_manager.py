"""Which KV-cache blocks each request holds, and automatic prefix caching (engine core).
The KV data itself lives in the worker; this is the bookkeeping.

With prefix caching on, every full block a request has computed is registered under its
chained hash (block_pool.py). A new request first looks up its own full blocks in order
and takes the leading run it finds (`get_computed_blocks`); the worker then starts it at
`num_computed_tokens > 0`. The last token is always computed again, so the step has
logits to sample from. Pooling requests keep no KV and never look up.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.engine.block_pool import BlockHash, BlockPool, hash_block, root_hash
from gateway.engine.request import Request
from gateway.messages import PrefixCacheStats


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_seed: str = "") -> None:
        """`hash_seed` names what the KV depends on besides the tokens (the model, its
        dtype): it seeds every request's hash chain."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self._root_hash = root_hash(f"{hash_seed}\0block_size={block_size}")
        self._stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """The fraction of blocks some request holds (a free cached block counts free)."""
        return 1.0 - self.pool.num_free / self.num_blocks if self.num_blocks else 0.0

    def blocks_needed(self, num_held: int, num_tokens: int) -> int:
        """Extra blocks to hold `num_tokens` tokens when `num_held` blocks are held."""
        return max(0, -(-num_tokens // self.block_size) - num_held)

    # ------------------------------------------------------------------ prefix lookups
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The cached blocks that begin `request` (holding none yet), and how many tokens
        they cover: a multiple of the block size, always short of the last token."""
        if not self.enable_caching or request.pooling_params is not None:
            return [], 0
        if request.sampling_params.prompt_logprobs is not None:
            return [], 0  # every prompt token must be computed for its logprob (as vLLM)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self._block_hashes(request, max_blocks):
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def record_lookup(self, request: Request, num_cached_tokens: int) -> None:
        """Count a scheduled request's lookup in the stats, in tokens (vLLM's queries and
        hits); a request back from preemption is not counted again."""
        if self.enable_caching and request.num_preemptions == 0 \
                and request.pooling_params is None:
            self._stats.requests += 1
            self._stats.queries += request.num_tokens
            self._stats.hits += num_cached_tokens

    def take_stats(self) -> PrefixCacheStats | None:
        """The lookups since the last call (None with caching off), and start afresh."""
        if not self.enable_caching:
            return None
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    # ------------------------------------------------------------------ holding blocks
    def allocate(self, request: Request, num_tokens: int,
                 computed_blocks: Sequence[int] = ()) -> list[int] | None:
        """Grow `request.block_ids` to hold `num_tokens`: first `computed_blocks` (from
        `get_computed_blocks`, for a request holding none), then new ones. Return the new
        blocks, or None (and change nothing) when too few are free."""
        held = len(request.block_ids) + len(computed_blocks)
        need = self.blocks_needed(held, num_tokens)
        if need > self.pool.num_free - self.pool.num_free_among(computed_blocks):
            return None
        if computed_blocks:
            self.pool.touch(computed_blocks)
            request.block_ids.extend(computed_blocks)
            request.num_cached_blocks = len(computed_blocks)
        new = self.pool.take(need)
        request.block_ids.extend(new)
        return new

    def cache_blocks(self, request: Request, num_computed: int | None = None) -> None:
        """Register the full blocks `request` has computed so far (after a step):
        `num_computed` tokens, by default all of `num_computed_tokens` (less under
        --async-scheduling, where that count includes a step still in flight)."""
        if num_computed is None:
            num_computed = request.num_computed_tokens
        num_full = num_computed // self.block_size
        if (not self.enable_caching or request.pooling_params is not None
                or num_full <= request.num_cached_blocks):
            return
        hashes = self._block_hashes(request, num_full)
        for index in range(request.num_cached_blocks, num_full):
            self.pool.cache(request.block_ids[index], hashes[index])
        request.num_cached_blocks = num_full

    def release_unused(self, request: Request) -> None:
        """Release the trailing blocks beyond the request's known tokens (they held only
        rejected draft tokens: never computed, never cached)."""
        num_kept = -(-request.num_tokens // self.block_size)
        if len(request.block_ids) > num_kept:
            self.pool.release(reversed(request.block_ids[num_kept:]))
            del request.block_ids[num_kept:]

    def free(self, request: Request) -> None:
        """Release the request's blocks, its last block first: a sequence's tail is the
        least likely to be shared, so it is evicted before its head."""
        self.pool.release(reversed(request.block_ids))
        request.block_ids.clear()
        request.num_cached_blocks = 0

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's first `num_blocks` block hashes, extending the ones it keeps (its
        tokens never change, so they stay valid across preemption)."""
        hashes, size = request.block_hashes, self.block_size
        parent = hashes[-1] if hashes else self._root_hash
        for index in range(len(hashes), num_blocks):
            parent = hash_block(parent, request.token_ids(index * size, (index + 1) * size),
                                request.cache_extra_key)
            hashes.append(parent)
        return hashes[:num_blocks]
