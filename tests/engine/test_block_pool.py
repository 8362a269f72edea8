"""The block pool and the KV-cache manager's prefix caching: hits, misses, the LRU
eviction order and reference counts, driven directly (no model)."""

from __future__ import annotations

import pytest

from gateway.engine.block_pool import hash_block, root_hash
from gateway.engine.kv_cache_manager import KVCacheManager
from gateway.engine.request import Request
from gateway.messages import EngineCoreRequest, PoolingParams
from gateway.sampling_params import SamplingParams

BLOCK = 4


def make_request(rid: str, prompt: list[int], pooling: bool = False) -> Request:
    return Request(EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=4), 0.0,
                                     PoolingParams() if pooling else None), 1024)


def compute(manager: KVCacheManager, request: Request) -> int:
    """Take the cached prefix, allocate the rest and "compute" the prompt; the hit."""
    blocks, num_cached = manager.get_computed_blocks(request)
    assert manager.allocate(request, request.num_tokens, blocks) is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request)
    return num_cached


def test_the_hash_chains_the_prefix_and_the_extra_key():
    root = root_hash("model-a")
    first = hash_block(root, [1, 2, 3, 4])
    assert hash_block(root, [1, 2, 3, 4]) == first
    # The same tokens after another prefix, for another model, or with an extra key differ.
    after_other = hash_block(hash_block(root, [9, 9, 9, 9]), [1, 2, 3, 4])
    assert after_other != hash_block(first, [1, 2, 3, 4]) != first
    assert hash_block(root_hash("model-b"), [1, 2, 3, 4]) != first
    assert hash_block(root, [1, 2, 3, 4], b"lora-1") != first
    assert hash_block(root, [1, 2, 3, 4], b"lora-1") != hash_block(root, [1, 2, 3, 4], b"lora-2")


def test_a_shared_prefix_hits_its_full_blocks_only():
    manager = KVCacheManager(16, BLOCK)
    first = make_request("a", list(range(10)))  # blocks [0..3] [4..7], then 2 tokens
    assert compute(manager, first) == 0
    second = make_request("b", list(range(9)) + [99, 98])  # shares 9 tokens: 2 full blocks
    assert compute(manager, second) == 8
    assert second.block_ids[:2] == first.block_ids[:2]
    assert second.block_ids[2] != first.block_ids[2]
    other = make_request("c", [5] + list(range(1, 10)))  # first block differs: nothing hits
    assert compute(manager, other) == 0


@pytest.mark.parametrize("prompt_len, expected_hit", [(8, 4), (9, 8), (12, 8), (3, 0)])
def test_the_last_token_is_always_computed_again(prompt_len, expected_hit):
    manager = KVCacheManager(16, BLOCK)
    compute(manager, make_request("a", list(range(prompt_len))))
    again = make_request("b", list(range(prompt_len)))
    assert compute(manager, again) == expected_hit < prompt_len


def test_shared_blocks_are_counted_and_freed_by_their_last_holder():
    manager = KVCacheManager(8, BLOCK)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    compute(manager, a)
    compute(manager, b)  # shares a's first two blocks
    shared = a.block_ids[:2]
    assert [manager.pool.ref_counts[i] for i in shared] == [2, 2]
    assert manager.num_free_blocks == 8 - 4  # 3 blocks each, 2 of them shared
    manager.free(a)
    assert [manager.pool.ref_counts[i] for i in shared] == [1, 1]
    assert manager.num_free_blocks == 8 - 3
    manager.free(b)
    assert manager.num_free_blocks == 8 and manager.usage == 0.0


def test_freed_blocks_stay_cached_until_the_pool_needs_room():
    manager = KVCacheManager(4, BLOCK)
    a = make_request("a", list(range(9)))
    compute(manager, a)
    manager.free(a)
    b = make_request("b", list(range(9)))
    assert compute(manager, b) == 8  # both full blocks taken back from the free queue
    manager.free(b)
    # 12 unrelated tokens need 3 of the 4 blocks: the two least recently released go
    # first, then b's second block; its first stays cached.
    compute(manager, make_request("c", list(range(100, 112))))
    assert manager.get_computed_blocks(make_request("d", list(range(9))))[1] == 4


def test_eviction_takes_the_least_recently_released_first_and_a_tail_before_its_head():
    manager = KVCacheManager(6, BLOCK)
    old, new = make_request("old", list(range(8))), make_request("new", list(range(50, 58)))
    compute(manager, old)
    compute(manager, new)
    old_blocks, new_blocks = list(old.block_ids), list(new.block_ids)
    manager.free(old)
    manager.free(new)
    # The free queue: the 2 never-used blocks, then old's tail, old's head, new's tail, head.
    order = list(manager.pool.free_queue)
    assert order[2:] == [old_blocks[1], old_blocks[0], new_blocks[1], new_blocks[0]]
    compute(manager, make_request("grab", list(range(100, 112))))  # 2 unused + old's tail
    assert manager.get_computed_blocks(make_request("old2", list(range(9))))[1] == 4
    assert manager.get_computed_blocks(make_request("new2", list(range(50, 59))))[1] == 8


def test_a_touched_free_block_is_not_handed_out_again():
    manager = KVCacheManager(3, BLOCK)
    a = make_request("a", list(range(5)))
    compute(manager, a)
    manager.free(a)  # both blocks free, block of [0..3] cached
    b = make_request("b", list(range(5)) + [7, 7, 7, 7])  # hit 1 block, needs 2 more
    blocks, num_cached = manager.get_computed_blocks(b)
    assert num_cached == 4
    new = manager.allocate(b, b.num_tokens, blocks)
    assert new is not None and blocks[0] not in new and len(set(b.block_ids)) == 3


def test_too_few_free_blocks_changes_nothing():
    manager = KVCacheManager(3, BLOCK)
    a = make_request("a", list(range(5)))
    compute(manager, a)
    manager.free(a)
    b = make_request("b", list(range(5)) + list(range(20, 30)))  # hit 1, needs 3 more
    blocks, _ = manager.get_computed_blocks(b)
    assert manager.allocate(b, b.num_tokens, blocks) is None
    assert b.block_ids == [] and manager.num_free_blocks == 3
    assert manager.pool.lookup(a.block_hashes[0]) is not None


@pytest.mark.parametrize("enable_caching, pooling", [(False, False), (True, True)])
def test_no_lookups_when_off_or_for_pooling(enable_caching, pooling):
    manager = KVCacheManager(8, BLOCK, enable_caching)
    compute(manager, make_request("a", list(range(9))))
    b = make_request("b", list(range(9)), pooling=pooling)
    assert manager.get_computed_blocks(b) == ([], 0)
    manager.record_lookup(b, 0)
    stats = manager.take_stats()
    if enable_caching:
        assert stats is not None and stats.queries == 0
    else:
        assert stats is None


def test_stats_count_tokens_queried_and_hit():
    manager = KVCacheManager(8, BLOCK)
    for rid in ("a", "b"):
        request = make_request(rid, list(range(9)))
        manager.record_lookup(request, compute(manager, request))
    stats = manager.take_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 18, 8)
    assert manager.take_stats().queries == 0  # taken: it starts afresh
