"""Executor `ray` (engine-core process): the tensor-parallel ranks as Ray actors.

`--distributed-executor-backend ray` (vLLM's flag). The engine core joins the Ray cluster
that RAY_ADDRESS names (`ray start --head` and its address, or an existing cluster), or
starts a local one when none is named, and asks it for one actor per rank
(worker/ray_worker.py); rank 0 is placed on this node, as it serves the ranks' rendezvous
at --master-addr. The actors get this process's PYTHONPATH and its VLLM_* and GATEWAY_*
variables, so plugins are found and allowed there as here.

Everything after placement is the `mp` executor's: rank 0 reaches the engine core through a
`multiprocessing.connection` socket (its pipe), and each actor is watched through a handle
that looks like a process to MultiprocExecutor: a sentinel that turns readable when the
actor's `run` call ends, which Ray makes happen when the actor dies. A dead actor raises
ExecutorDeadError at once; the engine core exits and the front end's engine-death path
does the rest. Ray ends the actors when the engine core (their owner) dies.
"""

from __future__ import annotations

import os
import secrets
import threading
from multiprocessing.connection import Connection, Listener, wait
from multiprocessing.process import BaseProcess
from typing import Any, cast

import msgspec

from gateway.config import EngineConfig
from gateway.executor.mp import MultiprocExecutor, with_master_port
from gateway.logger import init_logger
from gateway.messages import ModelRunnerOutput

logger = init_logger(__name__)

_FORWARDED_PREFIXES = ("VLLM_", "GATEWAY_", "HF_")
_CONNECT_TIMEOUT_S = 600.0  # rank 0 connects after Ray has placed and started it


class RayRankHandle:
    """One rank's actor, with the members MultiprocExecutor reads from a process."""

    def __init__(self, ray: Any, actor: Any, rank: int, run_ref: Any, pid: int) -> None:
        self.ray, self.actor, self.rank, self.pid = ray, actor, rank, pid
        self.exitcode: int | None = None
        self._read, self._write = os.pipe()
        self.sentinel = self._read  # readable once `run` has ended (or the actor died)
        threading.Thread(target=self._watch, args=(run_ref,), daemon=True,
                         name=f"gateway-ray-rank-{rank}").start()

    def _watch(self, run_ref: Any) -> None:
        try:
            self.ray.get(run_ref)
            self.exitcode = 0
        except Exception as exc:  # RayActorError: killed, crashed, node lost
            logger.error("Ray actor of worker rank %d (pid %d) ended: %s", self.rank,
                         self.pid, exc)
            self.exitcode = 1
        os.write(self._write, b"x")

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        wait([self.sentinel], timeout)

    def kill(self) -> None:
        self.ray.kill(self.actor, no_restart=True)


class RayExecutor(MultiprocExecutor):
    def __init__(self, config: EngineConfig) -> None:
        import ray

        self.config = with_master_port(config)
        self._ray = ray
        if not ray.is_initialized():
            # A local cluster of our own needs no dashboard; an operator's has its own.
            local: dict[str, Any] = (
                {} if os.environ.get("RAY_ADDRESS") else {"include_dashboard": False})
            ray.init(runtime_env={"env_vars": _forwarded_env()}, **local)
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        handles = start_rank_actors(ray, self.config, listener.address, authkey)
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
        if not was_shut_down and self._ray.is_initialized():
            self._ray.shutdown()


def start_rank_actors(ray: Any, config: EngineConfig, engine_address: tuple[str, int],
                      authkey: bytes) -> list[RayRankHandle]:
    """One actor per rank (rank 0 on this node), each running its rank's `run`."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from gateway.worker.ray_worker import RayRank

    remote_rank = ray.remote(num_cpus=0)(RayRank)
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    config_bytes = msgspec.msgpack.encode(config)
    handles = []
    for rank in range(config.parallel.tensor_parallel_size):
        options: dict[str, Any] = {"scheduling_strategy": here} if rank == 0 else {}
        actor = remote_rank.options(**options).remote()
        pid = int(ray.get(actor.getpid.remote()))
        run_ref = actor.run.remote(config_bytes, rank, engine_address if rank == 0 else None,
                                   authkey)
        handles.append(RayRankHandle(ray, actor, rank, run_ref, pid))
    return handles


def _accept(listener: Listener, handles: list[RayRankHandle]) -> Connection:
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
            raise RuntimeError(f"the workers did not start: the Ray actor of worker rank "
                               f"{dead[0].rank} (pid {dead[0].pid}) ended (see its log above)")
        waiter.join(0.5)
        waited += 0.5
    if not accepted:
        raise RuntimeError(f"worker rank 0 did not connect within {_CONNECT_TIMEOUT_S:.0f} s")
    return accepted[0]


def _forwarded_env() -> dict[str, str]:
    """The variables the actors need to find and allow the same plugins as this process."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_PREFIXES)}
    env.pop("GATEWAY_PROCESS_ROLE", None)  # each actor names itself
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


class _ClosedConnection:
    """Stands in for rank 0's connection when it never came (shutdown closes it)."""

    def send_bytes(self, data: bytes) -> None:
        raise OSError("rank 0 never connected")

    def close(self) -> None:
        pass
