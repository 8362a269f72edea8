"""One tensor-parallel rank as a Ray actor (worker process, placed by Ray).

The executor `ray` (executor/ray.py) makes one `RayRank` per rank and calls `run` once; it
lasts as long as the rank serves. It is worker_proc.py's process shell with Ray in the
place of multiprocessing: the actor names itself worker-<rank>, loads the general plugins
itself (a Ray worker is a new process), joins the ranks' rendezvous and runs the same
start-up phases and step loop; rank 0 reaches the engine core through a
`multiprocessing.connection` socket with the `mp` executor's messages. It leaves out the
parent-death signal and the SIGTERM handler: Ray owns the process, and kills the actor
when the engine core (its owner) dies or calls `ray.kill`.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Client

import msgspec

from gateway import envs
from gateway.config import EngineConfig


class RayRank:
    """The actor class (decorated with `ray.remote` by the executor, so importing this
    module needs no Ray)."""

    def getpid(self) -> int:
        return os.getpid()

    def run(self, config_bytes: bytes, rank: int, engine_address: tuple[str, int] | None,
            authkey: bytes) -> None:
        """Serve rank `rank` until SHUTDOWN (rank 0 connects to `engine_address`)."""
        config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        role = config.parallel.worker_role(rank)
        os.environ["GATEWAY_PROCESS_ROLE"] = role
        envs.default_openmp_waiting()  # before torch loads
        from gateway.logger import init_logger
        from gateway.worker.worker_proc import StartupFailed, _loop, _start, start_rank

        plugin_error = start_rank(role)
        from gateway.worker.distributed import TensorParallelGroup

        logger = init_logger("gateway.worker.ray_worker")
        engine_conn = (Client(engine_address, authkey=authkey)
                       if engine_address is not None else None)
        group = TensorParallelGroup.join(rank, config.parallel)
        try:
            worker = _start(config, group, engine_conn, None, plugin_error)
        except StartupFailed as exc:
            logger.error("Worker rank %d stops: %s", rank, exc)
            group.close()
            return
        _loop(worker, group, engine_conn)
        group.close()
