"""Executor `ray` (engine-core process): the tensor-parallel ranks as Ray actors
(`--distributed-executor-backend ray`, vLLM's flag).

The engine core joins the Ray cluster (gateway/ray_cluster.py) and asks it for one actor
per rank (worker/ray_worker.py); rank 0 is placed on this node, as it serves the ranks'
rendezvous at --master-addr. Everything after placement is the `mp` executor's: rank 0
reaches the engine core through a `multiprocessing.connection` socket (its pipe), and each
actor is watched through a handle that looks like a process (ray_cluster.RayActorHandle).
"""

from __future__ import annotations

import secrets
import threading
from multiprocessing.connection import Connection, Listener
from multiprocessing.process import BaseProcess
from typing import Any, cast

import msgspec

from gateway.config import EngineConfig
from gateway.executor.mp import MultiprocExecutor, with_master_port
from gateway.logger import init_logger
from gateway.messages import ModelRunnerOutput
from gateway.ray_cluster import RayActorHandle, RayCluster

logger = init_logger(__name__)

_CONNECT_TIMEOUT_S = 600.0  # rank 0 connects after Ray has placed and started it


class RayExecutor(MultiprocExecutor):
    """The `mp` executor over Ray actors. A dead actor raises ExecutorDeadError at once; the
    engine core exits and the front end's engine-death path does the rest. Ray ends the
    actors when the engine core (their owner) dies.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = with_master_port(config)
        self._cluster = RayCluster.join()
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        handles = start_rank_actors(self._cluster, self.config, listener.address, authkey)
        # Duck-typed: a handle has every member of a process that MultiprocExecutor reads.
        self.processes = cast(list[BaseProcess], handles)
        self._is_shut_down = False
        self._encoder = msgspec.msgpack.Encoder()
        self._output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
        try:
            self.conn = _accept(listener, handles)
            self.ready = self._await_ready()
        except BaseException:
            self.conn = _ClosedConnection()  # type: ignore[assignment]
            self.shutdown()
            raise
        finally:
            listener.close()
        self.num_kv_blocks = self.ready.num_kv_blocks
        self._log_ready()

    def shutdown(self) -> None:
        was_shut_down = self._is_shut_down
        super().shutdown()
        if not was_shut_down:
            self._cluster.leave()


def start_rank_actors(cluster: RayCluster, config: EngineConfig,
                      engine_address: tuple[str, int], authkey: bytes) -> list[RayActorHandle]:
    """One actor per rank (rank 0 on this node), each running its rank's `run`."""
    from gateway.worker.ray_worker import RayRank

    ray = cluster.ray
    remote_rank = ray.remote(num_cpus=0)(RayRank)
    here = cluster.on_this_node()
    config_bytes = msgspec.msgpack.encode(config)
    handles = []
    for rank in range(config.parallel.tensor_parallel_size):
        options: dict[str, Any] = {"scheduling_strategy": here} if rank == 0 else {}
        actor = remote_rank.options(**options).remote()
        pid = int(ray.get(actor.getpid.remote()))
        run_ref = actor.run.remote(config_bytes, rank, engine_address if rank == 0 else None,
                                   authkey)
        handle = RayActorHandle(ray, actor, f"worker rank {rank}", run_ref, pid)
        handle.rank = rank  # type: ignore[attr-defined]  # read by mp.describe_exit
        handles.append(handle)
    return handles


def _accept(listener: Listener, handles: list[RayActorHandle]) -> Connection:
    """Rank 0's connection; RuntimeError if an actor ends first or none comes in time.
    (Listener.accept has no timeout: it waits in a thread.)"""
    accepted: list[Connection] = []
    waiter = threading.Thread(target=lambda: accepted.append(listener.accept()),
                              daemon=True, name="gateway-ray-accept")
    waiter.start()
    waited = 0.0
    while waiter.is_alive() and waited < _CONNECT_TIMEOUT_S:
        dead = [h for h in handles if not h.is_alive()]
        if dead:
            raise RuntimeError(f"the workers did not start: the Ray actor of {dead[0].what} "
                               f"(pid {dead[0].pid}) ended (see its log above)")
        waiter.join(0.5)
        waited += 0.5
    if not accepted:
        raise RuntimeError(f"worker rank 0 did not connect within {_CONNECT_TIMEOUT_S:.0f} s")
    return accepted[0]


class _ClosedConnection:
    """Stands in for rank 0's connection when it never came (shutdown closes it)."""

    def send_bytes(self, data: bytes) -> None:
        raise OSError("rank 0 never connected")

    def close(self) -> None:
        pass
