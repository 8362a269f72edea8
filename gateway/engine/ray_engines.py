"""`--data-parallel-backend ray` (front-end process): the data-parallel engine cores as Ray
actors, placed by the Ray cluster (vLLM's flag and shape: its engine-core actors).

Each engine core is one `EngineCoreActor` (engine/core_proc.py) running the same engine
core as a spawned engine process, with its own executor and worker(s), and loading the
general plugins itself (an actor is a new process). The front end starts each one through
`EngineClient.start` with `RayEngine` as the launcher: the client binds its three ZMQ
sockets on TCP instead of ipc, at --data-parallel-address (or, by default, this node's
address as the Ray cluster knows it), and the actor connects to them from wherever Ray put
it. The sockets take no credentials (as vLLM's): the address belongs on a private network.
From the handshake on, that client is an engine client like any other, and
DataParallelEngineClient balances over them.

Each actor is watched through a `RayActorHandle`: its sentinel turns readable when the
actor's `run` ends, which Ray makes happen within moments when the actor dies, so the
client's engine-death path runs as for a process (in-flight requests fail, /health 503,
the server exits). The front end owns the actors: Ray ends them when it exits, even by
SIGKILL. Each actor asks Ray for one CPU, so the cluster places as many engines on a node
as it has CPUs for.
"""

from __future__ import annotations

import asyncio

from gateway.config import EngineConfig
from gateway.engine.client import EngineClient
from gateway.logger import init_logger
from gateway.models.paths import ModelInfo
from gateway.ray_cluster import RayActorHandle, RayCluster, forwarded_env

logger = init_logger(__name__)

ENGINE_ACTOR_CPUS = 1  # what each engine-core actor reserves on its node


class RayEngine:
    """EngineClient.start's launcher for one engine core as a Ray actor."""

    def __init__(self, cluster: RayCluster, rank: int, host: str) -> None:
        self.cluster = cluster
        self.rank = rank
        self.host = host
        self.handle: RayActorHandle | None = None

    def addresses(self, ipc_dir: str) -> tuple[str, str, str]:
        return (f"tcp://{self.host}:*",) * 3  # each binds a free port

    def start(self, config_bytes: bytes, input_addr: str, output_addr: str,
              heartbeat_addr: str) -> RayActorHandle:
        from gateway.engine.core_proc import EngineCoreActor  # light: imports no torch

        ray = self.cluster.ray
        engine_actor = ray.remote(num_cpus=ENGINE_ACTOR_CPUS)(EngineCoreActor)
        # Forwarded per actor, now: the gc-stats folder of this engine is set just here.
        actor = engine_actor.options(runtime_env={"env_vars": forwarded_env()}).remote()
        where_ref = actor.where.remote()  # before `run`: an actor runs one call at a time
        run_ref = actor.run.remote(config_bytes, input_addr, output_addr, heartbeat_addr)
        self.handle = RayActorHandle(ray, actor, f"data-parallel engine {self.rank}", run_ref,
                                     where_ref=where_ref)
        return self.handle


async def start_ray_engines(config: EngineConfig, startup_timeout_s: float,
                            model_info: ModelInfo | None
                            ) -> tuple[RayCluster, list[EngineClient]]:
    """Join the cluster and start every engine core on it at once (see dp_client.start_all:
    if one cannot start, the others are stopped); the cluster, to leave at shutdown."""
    from gateway.engine.dp_client import engine_config_for_rank, start_all

    # In a thread: joining takes seconds, and Ray sets no signal handler off the main
    # thread (the server's own SIGTERM handling, the drain, stays).
    cluster = await asyncio.to_thread(RayCluster.join)
    host = config.parallel.data_parallel_address or cluster.node_ip
    launchers = [RayEngine(cluster, rank, host)
                 for rank in range(config.parallel.data_parallel_size)]
    try:
        engines = await start_all([EngineClient.start(
            engine_config_for_rank(config, launcher.rank), startup_timeout_s, model_info,
            launcher) for launcher in launchers])
    except BaseException:
        await asyncio.to_thread(cluster.leave)
        raise
    for engine, launcher in zip(engines, launchers):
        _forget_remote_pids(engine, launcher.handle)
    logger.info("Data parallel on Ray: the engine cores are actors (%s), reaching this front "
                "end at %s.", ", ".join(f"{h.what} pid {h.pid} on {h.host}"
                                        for h in (la.handle for la in launchers) if h), host)
    return cluster, engines


def _forget_remote_pids(engine: EngineClient, handle: RayActorHandle | None) -> None:
    """An engine on another host: its pids mean nothing here (the process metrics read
    /proc, the gc stats a local folder), so they are not reported as this host's."""
    if handle is None or not handle.is_on_this_host:
        engine.process_pids = {}
        engine.gc_stats_dir = None

