"""How many compute threads a CPU worker runs, and on which cores (worker process).

On a machine with few cores, the worker's OpenMP threads share them with the front end, the
engine core's own Python and often the client; an OpenMP region waits for its slowest
thread, so a thread pushed off its core stalls the whole region. Two variables (read in
gateway/envs.py), vLLM's names and meaning: `VLLM_CPU_NUM_OF_RESERVED_CPU`, the allowed
cores the worker threads leave to the rest (default 0: `default_reserved_cores`), and
`VLLM_CPU_OMP_THREADS_BIND`: `auto` (the default) pins the worker to the last allowed
cores after the reserved ones, split between this machine's workers; `nobind` pins
nothing; a list such as `2-5` or `0,2,4` (`|` between ranks) is used as given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


@dataclass(frozen=True)
class ThreadPlan:
    num_threads: int
    cores: tuple[int, ...] | None  # None: no pinning

    def describe(self) -> str:
        where = "unpinned" if self.cores is None else f"cores {_ranges(self.cores)}"
        return f"{self.num_threads} threads, {where}"


def default_reserved_cores(num_cores: int, num_workers: int) -> int:
    """None, as vLLM's CPU backend does for a single worker: a core left to the front end
    did not shorten batch-1 gaps beyond noise and cost many-client throughput
    (docs/cpu-performance.md, VLLM_CPU_NUM_OF_RESERVED_CPU)."""
    return 0


def plan_threads(allowed: list[int], num_workers: int, rank: int, *, placement: bool = True,
                 reserved: str | None = None, bind: str = "auto") -> ThreadPlan:
    """The threads and cores of worker `rank` (of `num_workers` on this machine), from the
    two variables' text (`reserved` None: the default).

    `placement` False (a worker inside a user's or a test's own process): the allowed cores
    shared between the workers, nothing reserved, nothing pinned."""
    if not placement:
        return ThreadPlan(max(1, len(allowed) // max(1, num_workers)), None)
    if bind not in ("auto", "nobind"):
        lists = bind.split("|")
        if len(lists) <= rank:
            raise ValueError(f"{BIND_ENV}={bind!r} names cores for {len(lists)} rank(s); "
                             f"rank {rank} has none")
        cores = _parse_cores(lists[rank], BIND_ENV)
        return ThreadPlan(len(cores), tuple(cores))
    usable = sorted(allowed)[_reserved(reserved, len(allowed), num_workers):]
    per_worker = max(1, len(usable) // max(1, num_workers))
    if bind == "nobind" or len(usable) < num_workers:
        return ThreadPlan(per_worker, None)
    return ThreadPlan(per_worker, tuple(usable[rank * per_worker:(rank + 1) * per_worker]))


def apply_threads(plan: ThreadPlan) -> None:
    """Pin this thread (and so the compute threads it starts later) and set torch's count.
    Call before the first parallel region: OpenMP threads keep the mask they started with."""
    import torch

    if plan.cores is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, plan.cores)
    torch.set_num_threads(plan.num_threads)


def allowed_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def _reserved(text: str | None, num_cores: int, num_workers: int) -> int:
    if text is None:
        return default_reserved_cores(num_cores, num_workers)
    try:
        reserved = int(text)
    except ValueError:
        raise ValueError(f"{RESERVED_ENV}={text!r} is not a whole number of cores") from None
    if not 0 <= reserved < num_cores:
        raise ValueError(f"{RESERVED_ENV}={reserved} must leave at least one of the "
                         f"{num_cores} allowed cores to the worker")
    return reserved


def _parse_cores(text: str, name: str) -> list[int]:
    cores: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cores += range(int(first), int(last or first) + 1)
    except ValueError:
        raise ValueError(f"{name}: {text!r} is not a core list such as '0-3' or '0,2'") from None
    if not cores:
        raise ValueError(f"{name}: {text!r} names no core")
    return cores


def _ranges(cores: tuple[int, ...]) -> str:
    return ",".join(map(str, cores))
