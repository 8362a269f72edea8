"""How the model is split across tensor-parallel ranks: heads by whole KV groups (unevenly
when they do not divide), the intermediate size as evenly as possible, the vocabulary
padded to a multiple of the ranks, fused projections part by part; and what cannot be
split is refused, naming counts."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from gateway.models.layers.parallel import (
    MergedLinear,
    Slice,
    VocabShard,
    rank_slice,
    shard_heads,
    split_sizes,
)


@dataclass
class Ranks:
    """A rank of `size` as the shard arithmetic sees it (no collectives run here)."""

    rank: int
    size: int


@pytest.mark.parametrize(("total", "parts", "sizes"), [
    (9, 3, [3, 3, 3]), (3, 2, [2, 1]), (1536, 2, [768, 768]), (5, 3, [2, 2, 1]), (7, 1, [7])])
def test_sizes_are_as_even_as_possible_larger_first(total, parts, sizes):
    assert split_sizes(total, parts) == sizes
    assert [rank_slice(total, Ranks(r, parts)) for r in range(parts)] == [
        Slice(sum(sizes[:r]), sizes[r]) for r in range(parts)]


def test_the_default_models_heads_split_two_and_one_kv_groups():
    # SmolLM2-135M: 9 query heads sharing 3 KV heads (groups of 3).
    shards = [shard_heads(9, 3, Ranks(r, 2)) for r in range(2)]
    assert [(s.kv_heads, s.q_heads) for s in shards] == [
        (Slice(0, 2), Slice(0, 6)), (Slice(2, 1), Slice(6, 3))]


def test_each_rank_keeps_the_query_heads_of_its_kv_heads():
    for size in (1, 2, 4):
        shards = [shard_heads(8, 4, Ranks(r, size)) for r in range(size)]
        assert sum(s.q_heads.size for s in shards) == 8
        assert all(s.q_heads.start == 2 * s.kv_heads.start and s.q_heads.size == 2 * s.kv_heads.size
                   for s in shards)


def test_fewer_kv_heads_than_ranks_is_refused_naming_the_counts():
    with pytest.raises(ValueError, match=r"2 key-value heads \(4 query heads\).*3 "
                                         r"tensor-parallel ranks.*at most 2"):
        shard_heads(4, 2, Ranks(0, 3))


@pytest.mark.parametrize(("vocab", "size"), [(512, 2), (301, 2), (49152, 3), (10, 4), (5, 4)])
def test_vocab_shards_cover_the_vocabulary_once_with_zero_padding(vocab, size):
    table = torch.arange(vocab, dtype=torch.float32).unsqueeze(1).repeat(1, 3)  # [V, 3]
    shards = [VocabShard.of(vocab, Ranks(r, size)) for r in range(size)]
    assert len({s.size for s in shards}) == 1 and shards[0].size * size >= vocab
    rows = torch.cat([s.checkpoint_rows(table) for s in shards])  # [padded V, 3]
    assert torch.equal(rows[:vocab], table)
    assert not rows[vocab:].any()
    assert sum(s.num_real for s in shards) == vocab


def test_a_merged_linear_takes_its_rows_from_parts_stored_apart_or_fused():
    """q, k, v of 4 + 2 + 2 rows over 2 ranks: each rank's rows of each part, whether the
    checkpoint stores the parts one by one or as one tensor (Phi-3)."""
    q, k, v = (torch.arange(rows * 3, dtype=torch.float32).view(rows, 3) + base
               for rows, base in ((4, 0), (2, 100), (2, 200)))
    for rank in range(2):
        heads = shard_heads(4, 2, Ranks(rank, 2))
        q_start, kv_start = heads.q_heads.start, heads.kv_heads.start
        layer = MergedLinear(3, (heads.q_heads.size, 1, 1), bias=False,
                             row_starts=(q_start, kv_start, kv_start), full_sizes=(4, 2, 2))
        apart = [layer.checkpoint_part("weight", shard, part)
                 for shard, part in enumerate((q, k, v))]
        assert torch.equal(torch.cat(apart), layer.checkpoint_part(
            "weight", None, torch.cat((q, k, v))))
        assert torch.equal(apart[0], q[q_start:q_start + 2])
        assert torch.equal(apart[2], v[kv_start:kv_start + 1])
    one_rank = MergedLinear(3, (4, 2, 2), bias=False, row_starts=(0, 0, 0))
    fused = torch.cat((q, k, v))
    assert one_rank.checkpoint_part("weight", None, fused) is fused
