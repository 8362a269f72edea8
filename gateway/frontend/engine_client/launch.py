"""Starting the engine connections, in the front end: one engine core, or one per
data-parallel rank (`--data-parallel-size N`), all at once.

Each engine core of a data-parallel set has a whole copy of the model, its own executor,
worker(s), KV cache and scheduler, and its own configuration (`engine_config_for_rank`).
If one cannot start, the others are stopped and start-up fails naming it. The Ray backend
starts its actors through the same `start_all` (ray_engines.py); several API servers
connect to engine cores the supervisor started (scaling/server_proc.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import msgspec

from gateway.config import EngineConfig
from gateway.frontend.engine_client.connection import EngineConnection, SpawnedEngine
from gateway.frontend.engine_client.errors import EngineStartError
from gateway.logger import init_logger

logger = init_logger(__name__)


def engine_config_for_rank(config: EngineConfig, rank: int) -> EngineConfig:
    """Engine `rank`'s configuration: its index, and its own rendezvous port when the
    operator fixed one (engine r uses --master-port + r; else each picks a free one)."""
    parallel = config.parallel
    port = None if parallel.master_port is None else parallel.master_port + rank
    return msgspec.structs.replace(config, parallel=msgspec.structs.replace(
        parallel, data_parallel_rank=rank, master_port=port))


async def start_local_engines(config: EngineConfig, startup_timeout_s: float
                              ) -> list[EngineConnection]:
    """Spawn the engine core (or, data parallel, every rank's) and connect to each."""
    size = config.parallel.data_parallel_size
    if size == 1:
        return [await EngineConnection.start(config, SpawnedEngine(), startup_timeout_s)]
    connections = await start_all([EngineConnection.start(
        engine_config_for_rank(config, rank), SpawnedEngine(), startup_timeout_s, rank)
        for rank in range(size)])
    logger.info("Data parallel: %d engine cores (pids %s), requests balanced on their "
                "reported load.", size, ", ".join(str(c.pid) for c in connections))
    return connections


async def start_all(starts: list[Coroutine[Any, Any, EngineConnection]]
                    ) -> list[EngineConnection]:
    """Await every connection's start (or connect) at once, in rank order. If one cannot
    start, shut down those that did and raise its EngineStartError, naming the engine
    (`data-parallel engine 1 of 2: ...`) when there are several."""
    size = len(starts)
    tasks = [asyncio.ensure_future(start) for start in starts]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException as exc:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        started = [t.result() for t in tasks if not t.cancelled() and t.exception() is None]
        await asyncio.gather(*(connection.shutdown() for connection in started),
                             return_exceptions=True)
        if isinstance(exc, EngineStartError) and size > 1:
            failed = next(rank for rank, task in enumerate(tasks)
                          if not task.cancelled() and task.exception() is exc)
            raise EngineStartError(f"data-parallel engine {failed} of {size}: {exc}") \
                from None
        raise
