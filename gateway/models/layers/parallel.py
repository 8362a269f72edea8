"""Tensor parallelism, model side (worker process): which part of each weight a rank holds,
and the layers whose forward needs a collective.

With N ranks, rank r holds: attention's whole KV heads, each with its query heads (q/k/v
column-parallel in one `MergedLinear`; o_proj row-parallel, all-reduced); a slice of the
MLP's and each expert's (moe.py) intermediate size (gate/up by rows, down by columns); a
slice of the vocabulary padded to a multiple of N for the embedding (tokens outside it
embed to zeros, all-reduced) and lm_head (logits all-gathered, trimmed). Splits may be
uneven, larger parts first. A module holding part of a checkpoint tensor names the part
in `checkpoint_part(param_name, shard, tensor)`, which the loader calls before copying.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class TensorParallel(Protocol):
    """The ranks a model is split over, as the model sees them."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (same shape on all) concatenated along the last dim."""
        ...


class SingleRank:
    """No tensor parallelism: one rank, collectives are the identity."""

    rank = 0
    size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


SINGLE_RANK = SingleRank()


@dataclass(frozen=True)
class Slice:
    """A contiguous part [start, start + size) of something split over ranks."""

    start: int
    size: int


def split_sizes(total: int, num_parts: int) -> list[int]:
    """`total` in `num_parts` sizes as even as possible, larger first: 3 over 2 -> [2, 1]."""
    base, extra = divmod(total, num_parts)
    return [base + (part < extra) for part in range(num_parts)]


def rank_slice(total: int, tp: TensorParallel) -> Slice:
    sizes = split_sizes(total, tp.size)
    return Slice(sum(sizes[:tp.rank]), sizes[tp.rank])


@dataclass(frozen=True)
class HeadShard:
    q_heads: Slice
    kv_heads: Slice


def shard_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadShard:
    """This rank's KV heads and the query heads that read them."""
    if num_kv_heads < tp.size:
        raise ValueError(
            f"The model has {num_kv_heads} key-value heads ({num_heads} query heads), which "
            f"cannot be split across {tp.size} tensor-parallel ranks: each rank needs at "
            f"least one whole KV head. Use a tensor-parallel size of at most {num_kv_heads}.")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
    group = num_heads // num_kv_heads
    kv = rank_slice(num_kv_heads, tp)
    return HeadShard(Slice(kv.start * group, kv.size * group), kv)


class MergedLinear(nn.Linear):
    """Projections of one input fused into one matmul (q, k, v; gate, up): `shard_sizes`
    are the rank's output rows of each, in checkpoint order. Column-parallel: of each
    checkpoint tensor, whole `full_sizes` rows, a rank holds rows [start, start + size),
    `row_starts` giving the starts (None: one rank holds them all).

    The loader fills the parts one by one where the checkpoint stores them apart (a
    `packed_modules_mapping` names them, `shard` is the part), or copies one tensor where
    it stores them fused (Phi-3; `shard` None): each part's rows are then cut out of it."""

    def __init__(self, in_features: int, shard_sizes: tuple[int, ...], bias: bool,
                 row_starts: tuple[int, ...] | None = None,
                 full_sizes: tuple[int, ...] | None = None) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes, self.row_starts = shard_sizes, row_starts
        self.full_sizes = full_sizes or shard_sizes

    def checkpoint_part(self, param_name: str, shard: int | None,
                        tensor: torch.Tensor) -> torch.Tensor:
        if self.row_starts is None or (shard is None
                                       and tensor.shape[0] == sum(self.shard_sizes)):
            return tensor
        if shard is not None:
            return tensor.narrow(0, self.row_starts[shard], self.shard_sizes[shard])
        parts = tensor.split(self.full_sizes)  # stored fused: [sum(full_sizes), ...]
        return torch.cat([part.narrow(0, start, size) for part, start, size
                          in zip(parts, self.row_starts, self.shard_sizes, strict=True)])


class RowParallelLinear(nn.Linear):
    """y_r = x_r W_r^T (+ b on rank 0): the rank's input columns; the caller all-reduces the
    partial sums. A plain nn.Linear otherwise, so the CPU packing still applies."""

    def __init__(self, inputs: Slice, out_features: int, bias: bool,
                 tp: TensorParallel) -> None:
        super().__init__(inputs.size, out_features, bias=bias)
        self.inputs, self.rank = inputs, tp.rank

    def checkpoint_part(self, param_name: str, shard: int | None,
                        tensor: torch.Tensor) -> torch.Tensor:
        if param_name == "bias":  # added once: the all-reduce sums the ranks' outputs
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        return tensor.narrow(1, self.inputs.start, self.inputs.size)


@dataclass(frozen=True)
class VocabShard:
    """The rank's rows [start, start + size) of the vocabulary padded to a multiple of N;
    `num_real` of them (at the start) exist in the checkpoint."""

    start: int
    size: int
    num_real: int

    @classmethod
    def of(cls, vocab_size: int, tp: TensorParallel) -> VocabShard:
        size = -(-vocab_size // tp.size)
        start = tp.rank * size
        return cls(start, size, max(0, min(size, vocab_size - start)))

    def checkpoint_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """[vocab, E] -> this shard's [size, E], zero rows for the padding."""
        rows = tensor.narrow(0, min(self.start, tensor.shape[0]), self.num_real)
        if self.num_real == self.size:
            return rows
        return torch.cat((rows, rows.new_zeros(self.size - self.num_real, *rows.shape[1:])))


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        shard = VocabShard.of(vocab_size, tp)
        super().__init__(shard.size, hidden_size)
        self.shard, self.tp = shard, tp

    def reset_parameters(self) -> None:
        # No random init: the checkpoint fills the weight. (nn.Embedding's normal_ on the
        # meta device would also import torch._dynamo, seconds of every worker's start-up.)
        pass

    def checkpoint_part(self, param_name: str, shard: int | None,
                        tensor: torch.Tensor) -> torch.Tensor:
        return self.shard.checkpoint_rows(tensor)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard.start  # [N]
        is_mine = (local >= 0) & (local < self.shard.num_real)
        out = F.embedding(torch.where(is_mine, local, 0), self.weight)  # [N, E]
        out.mul_(is_mine.unsqueeze(1).to(out.dtype))
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Linear):
    """The rank's vocabulary rows of the output layer; `gather_logits` joins the ranks'."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel) -> None:
        shard = VocabShard.of(vocab_size, tp)
        super().__init__(hidden_size, shard.size, bias=False)
        self.shard = shard

    def checkpoint_part(self, param_name: str, shard: int | None,
                        tensor: torch.Tensor) -> torch.Tensor:
        return self.shard.checkpoint_rows(tensor)


def gather_logits(local: torch.Tensor, vocab_size: int, tp: TensorParallel) -> torch.Tensor:
    """[R, V_padded / N] on each rank -> [R, vocab_size] on every rank."""
    if tp.size == 1:
        return local
    return tp.all_gather(local)[:, :vocab_size]
