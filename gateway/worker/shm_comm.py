"""Collectives between the CPU ranks of one machine through shared memory (worker process).

A decode step runs 2 all-reduces per layer, and through gloo (TCP over loopback, a helper
thread per operation) each costs more than the split saves on a small model. Here each
rank copies its tensor into its slot of a shared buffer, the ranks meet at a barrier, and
every rank sums the slots in rank order, so all ranks get the same bits. Two buffers
alternate, so one barrier per operation suffices. The barrier is one POSIX semaphore per
pair of ranks (`semaphores[receiver][sender]`): a futex wake, no spinning (on a shared
machine a spinning rank takes the core its peer needs); the semaphores also order the
memory, so what a rank wrote before posting is visible to the rank that waited.
"""

from __future__ import annotations

import mmap
import os
import tempfile

import torch

from gateway.worker.local_sync import LocalSync

_BUFFERS = 2
# A rank that does not reach a collective for this long is stuck (a dead rank is noticed
# sooner: the engine core sees it exit and stops every worker).
_BARRIER_TIMEOUT_S = 1800.0


class SharedMemoryCollectives:
    """This rank's view of the shared buffers. Two buffers alternate, so one barrier per
    operation suffices: a rank writes a buffer again only two operations later, after every
    rank has passed the barrier in between, i.e. finished reading it.
    """

    def __init__(self, sync: LocalSync, rank: int, path: str, slot_bytes: int) -> None:
        self.sync, self.rank, self.size = sync, rank, sync.num_ranks
        self.slot_bytes = slot_bytes
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), buffer_size(self.size, slot_bytes))
        data = torch.frombuffer(self._map, dtype=torch.uint8)
        self._slots = data.view(_BUFFERS, self.size, slot_bytes)
        self._num_barriers = 0

    def fits(self, tensor: torch.Tensor) -> bool:
        """Whether this buffer can carry `tensor` (the same answer on every rank: the
        ranks' tensors have the same shape); if not, the caller uses gloo."""
        return (tensor.device.type == "cpu" and tensor.is_contiguous()
                and tensor.numel() * tensor.element_size() <= self.slot_bytes)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place, in rank order: the same bits on every rank."""
        slots = self._exchange(tensor)
        out = tensor.view(-1)
        out.copy_(slots[0])
        for slot in slots[1:]:
            out.add_(slot)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's tensor concatenated along the last dim."""
        slots = self._exchange(tensor)
        return torch.cat([slot.view(tensor.shape) for slot in slots], dim=-1)

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Publish `tensor`, wait for every rank's; their slots (flat, tensor's dtype)."""
        buffer = self._slots[self._num_barriers % _BUFFERS]
        num_bytes = tensor.numel() * tensor.element_size()
        flat = [buffer[rank, :num_bytes].view(tensor.dtype) for rank in range(self.size)]
        flat[self.rank].copy_(tensor.reshape(-1))
        self._barrier()
        return flat

    def _barrier(self) -> None:
        self._num_barriers += 1
        semaphores = self.sync.semaphores
        others = [other for other in range(self.size) if other != self.rank]
        for other in others:
            semaphores[other][self.rank].release()
        for other in others:
            if not semaphores[self.rank][other].acquire(timeout=_BARRIER_TIMEOUT_S):
                raise RuntimeError(f"rank {other} did not reach a collective within "
                                   f"{_BARRIER_TIMEOUT_S:.0f} s")


def buffer_size(num_ranks: int, slot_bytes: int) -> int:
    return _BUFFERS * num_ranks * slot_bytes


def create_buffer_file(num_ranks: int, slot_bytes: int) -> str:
    """A file in shared memory (/dev/shm where there is one) for the ranks to map."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="gateway-tp-", dir=folder)
    try:
        os.ftruncate(fd, buffer_size(num_ranks, slot_bytes))
    finally:
        os.close(fd)
    return path
