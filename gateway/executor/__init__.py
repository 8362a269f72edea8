"""Executors (engine-core process): how the engine core reaches the worker(s).

`uni` (uni.py): one worker inside the engine-core process. `mp` (mp.py): one worker
process per tensor-parallel rank, joined with torch.distributed. `ray` (ray.py): the same
ranks as Ray actors. All answer the same calls, so EngineCore does not know which it has.
"""

from __future__ import annotations

from gateway.config import EngineConfig
from gateway.executor.abstract import Executor, ExecutorDeadError

__all__ = ["Executor", "ExecutorDeadError", "make_executor"]


def make_executor(config: EngineConfig) -> Executor:
    config.parallel.validate()
    if config.parallel.distributed_executor_backend == "ray":
        from gateway.executor.ray import RayExecutor
        return RayExecutor(config)
    if config.parallel.uses_worker_processes:
        from gateway.executor.mp import MultiprocExecutor
        return MultiprocExecutor(config)
    from gateway.executor.uni import UniExecutor
    return UniExecutor(config)
