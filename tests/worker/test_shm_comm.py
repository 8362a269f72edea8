"""Collectives through shared memory between real processes (3 ranks, so the sum has more
than one addition): every rank gets the same bits, operations back to back reuse the two
buffers safely, and a tensor that does not fit is left to gloo."""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import torch

from gateway.worker.local_sync import LocalSync
from gateway.worker.shm_comm import SharedMemoryCollectives, create_buffer_file

NUM_RANKS = 3
NUM_ROUNDS = 40
SLOT_BYTES = 4096


def _rank_tensor(rank: int, round_: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * round_ + rank)
    return torch.randn(4, 8, generator=generator).to(torch.bfloat16)


def _run_rank(sync: LocalSync, rank: int, path: str, results: Any) -> None:
    shared = SharedMemoryCollectives(sync, rank, path, SLOT_BYTES)
    reduced, gathered = [], []
    for round_ in range(NUM_ROUNDS):  # alternating kinds, back to back
        mine = _rank_tensor(rank, round_)
        reduced.append(shared.all_reduce(mine.clone()))
        gathered.append(shared.all_gather(mine))
    too_big = torch.zeros(SLOT_BYTES // 4 + 1, dtype=torch.float32)
    results.put((rank, torch.stack(reduced).view(torch.int16).tolist(),
                 torch.stack(gathered).view(torch.int16).tolist(), shared.fits(too_big),
                 shared.fits(torch.zeros(SLOT_BYTES // 4))))


def test_ranks_reduce_and_gather_the_same_bits_through_shared_memory():
    context = multiprocessing.get_context("spawn")
    sync = LocalSync(context, NUM_RANKS)
    path = create_buffer_file(NUM_RANKS, SLOT_BYTES)
    results = context.Queue()
    processes = [context.Process(target=_run_rank, args=(sync, rank, path, results))
                 for rank in range(NUM_RANKS)]
    try:
        for process in processes:
            process.start()
        items = [results.get(timeout=120) for _ in range(NUM_RANKS)]
        by_rank = {item[0]: item[1:] for item in items}
        for process in processes:
            process.join(timeout=30)
    finally:
        os.unlink(path)
        for process in processes:
            if process.is_alive():
                process.kill()
    assert [process.exitcode for process in processes] == [0] * NUM_RANKS

    expected_reduced = []
    expected_gathered = []
    for round_ in range(NUM_ROUNDS):
        parts = [_rank_tensor(rank, round_) for rank in range(NUM_RANKS)]
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part)  # in rank order, in bfloat16, as the ranks add
        expected_reduced.append(total)
        expected_gathered.append(torch.cat(parts, dim=-1))
    reduced = torch.stack(expected_reduced).view(torch.int16).tolist()
    gathered = torch.stack(expected_gathered).view(torch.int16).tolist()
    for rank in range(NUM_RANKS):
        assert by_rank[rank][0] == reduced, rank
        assert by_rank[rank][1] == gathered, rank
        assert by_rank[rank][2:] == (False, True)  # one element over the slot: gloo's
