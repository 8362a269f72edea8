"""The semaphores the tensor-parallel ranks of one machine meet at (made where the ranks are
spawned, used in each worker process by shm_comm.py); torch-free."""

from __future__ import annotations

from multiprocessing.context import BaseContext
from typing import Any


class LocalSync:
    """Made by the process that spawns the ranks and handed to each at spawn:
    `semaphores[receiver][sender]`."""

    def __init__(self, context: BaseContext, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self.semaphores: list[list[Any]] = [
            [context.Semaphore(0) if receiver != sender else None for sender in range(num_ranks)]
            for receiver in range(num_ranks)]
