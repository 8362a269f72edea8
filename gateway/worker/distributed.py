"""The tensor-parallel ranks' process groups (worker process).

Two groups over the same ranks. The control group, gloo over TCP on every platform, is
joined first (before the plugins and the platform are known); start-up statuses and every
step's message from the engine core go over it from rank 0, and torch.distributed's TCP
store at master_addr:master_port is the rendezvous, for ranks on other nodes as for local
ones. The device group is the platform's backend (nccl on CUDA), for the model's
all-reduce and all-gather; on CPU it is the control group itself, and when every rank runs
on this machine the collectives go through shared memory instead (shm_comm.py).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gateway.config import ParallelConfig
from gateway.worker.local_sync import LocalSync
from gateway.worker.shm_comm import SharedMemoryCollectives, create_buffer_file

# Ranks on other nodes may start a while after rank 0 (an operator starting hosts by hand).
_RENDEZVOUS_TIMEOUT = timedelta(minutes=10)
# How long a collective waits for the other ranks: covers the slowest rank's model load.
# Idle waits stay far below it because rank 0 broadcasts a keepalive (worker_proc.py).
_COLLECTIVE_TIMEOUT = timedelta(minutes=30)
# A step's message fits in one broadcast of this many bytes (length included) unless it
# carries long prompts; the rest then follows in a second broadcast.
_FIRST_BROADCAST_BYTES = 4096
_LENGTH_BYTES = 8


def _listen(host: str, port: int) -> int:
    """A listening socket on `host`:`port`, handed over (as its descriptor) to the store."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=128)
    return listener.detach()


class TensorParallelGroup:
    """The ranks one model is split over, as a worker process sees them (a TensorParallel
    for the model: `rank`, `size`, `all_reduce`, `all_gather`)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.device_group: Any = None  # set by use_device
        self.shared: SharedMemoryCollectives | None = None  # CPU ranks of one machine

    @classmethod
    def join(cls, rank: int, parallel: ParallelConfig) -> TensorParallelGroup:
        """Join the control group: rank 0 serves the rendezvous store, the others connect
        to it (retrying until it is up)."""
        size = parallel.tensor_parallel_size
        assert parallel.master_port is not None, "the executor picks the port"
        # Rank 0 serves the store on master_addr alone (torch's own server would listen on
        # every interface): on loopback, nothing of a one-machine group is reachable from
        # outside.
        listen_fd = _listen(parallel.master_addr, parallel.master_port) if rank == 0 else None
        store = dist.TCPStore(parallel.master_addr, parallel.master_port, size,
                              is_master=rank == 0, timeout=_RENDEZVOUS_TIMEOUT,
                              master_listen_fd=listen_fd)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size,
                                timeout=_COLLECTIVE_TIMEOUT)
        return cls(rank, size)

    def use_device(self, backend: str, device: torch.device, local_sync: LocalSync | None,
                   slot_bytes: int) -> None:
        """Run the model's collectives with `backend` (the platform's) on `device`; CPU
        ranks that all run on this machine (`local_sync` given) use shared memory for
        tensors up to `slot_bytes`."""
        if backend != "gloo":
            if device.type == "cuda":
                torch.cuda.set_device(device)
            self.device_group = dist.new_group(backend=backend)
            return
        self.device_group = dist.group.WORLD
        if local_sync is not None and device.type == "cpu":
            self.shared = self._map_shared_buffer(local_sync, slot_bytes)

    def _map_shared_buffer(self, sync: LocalSync, slot_bytes: int) -> SharedMemoryCollectives:
        path = create_buffer_file(self.size, slot_bytes) if self.rank == 0 else None
        try:
            path = self.broadcast_bytes(path.encode() if path else None).decode()
            shared = SharedMemoryCollectives(sync, self.rank, path, slot_bytes)
            self.all_gather_bytes(b"mapped")  # every rank has it mapped: the name can go
        finally:
            if self.rank == 0 and path is not None:
                os.unlink(path)
        return shared

    # ------------------------------------------------------------------ for the model
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.shared is not None and self.shared.fits(tensor):
            return self.shared.all_reduce(tensor)
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        if self.shared is not None and self.shared.fits(tensor):
            return self.shared.all_gather(tensor)
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor, group=self.device_group)
        return torch.cat(parts, dim=-1)

    # ------------------------------------------------------------------ control messages
    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0's `payload` on every rank (the others pass None)."""
        head = torch.zeros(_FIRST_BROADCAST_BYTES, dtype=torch.uint8)
        if self.rank == 0:
            assert payload is not None
            first = len(payload).to_bytes(_LENGTH_BYTES, "little") + payload[
                :_FIRST_BROADCAST_BYTES - _LENGTH_BYTES]
            head[:len(first)] = _as_tensor(first)
        dist.broadcast(head, src=0)
        length = int.from_bytes(head[:_LENGTH_BYTES].numpy().tobytes(), "little")
        in_head = min(length, _FIRST_BROADCAST_BYTES - _LENGTH_BYTES)
        rest = torch.empty(length - in_head, dtype=torch.uint8)
        if rest.numel():
            if self.rank == 0:
                assert payload is not None
                rest.copy_(_as_tensor(payload[in_head:]))
            dist.broadcast(rest, src=0)
        if self.rank == 0:
            assert payload is not None
            return payload
        return (head[_LENGTH_BYTES:_LENGTH_BYTES + in_head].numpy().tobytes()
                + rest.numpy().tobytes())

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's `payload`, in rank order, on every rank."""
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(lengths, torch.tensor([len(payload)], dtype=torch.int64))
        longest = max(int(length) for length in lengths)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(payload)] = _as_tensor(payload)
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        dist.all_gather(parts, mine)
        return [part[:int(length)].numpy().tobytes() for part, length in zip(parts, lengths)]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
