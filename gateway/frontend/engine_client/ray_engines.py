"""`--data-parallel-backend ray` (API-server process, or the supervisor with several API
servers): the data-parallel engine cores as Ray actors placed by the Ray cluster (vLLM's
flag and shape). Each is one `EngineCoreActor` (engine/core_proc.py) running the same
engine core as a spawned one, loading the general plugins itself (a new process).

Its sockets are TCP at --data-parallel-address (by default this node's address as Ray
knows it) and take no credentials, as vLLM's: the address belongs on a private network.
Each actor is watched through a `RayActorHandle`, so its death runs the engine-death path
as a process's does. The front end (or the supervisor, which tells the API servers when
one ends: `EngineActorsForApiServers`) owns the actors: Ray ends them when it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import socket
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from gateway.config import EngineConfig
from gateway.frontend.engine_client.connection import (
    EngineConnection,
    EngineNoticeHandle,
)
from gateway.frontend.engine_client.launch import engine_config_for_rank, start_all
from gateway.logger import init_logger
from gateway.ray_cluster import RayActorHandle, RayCluster, forwarded_env

logger = init_logger(__name__)

ENGINE_ACTOR_CPUS = 1  # what each engine-core actor reserves on its node
PLACEMENT_TIMEOUT_S = 600.0  # how long Ray may take to place every engine


@dataclass(frozen=True)
class PlacedEngine:
    """An engine actor Ray has placed, before its `run`."""

    rank: int
    actor: Any
    pid: int
    host: str


def place_engine_actors(cluster: RayCluster, size: int) -> list[PlacedEngine]:
    """One engine actor per rank, once Ray has placed them all (blocking)."""
    from gateway.engine.core_proc import EngineCoreActor  # light: imports no torch

    ray = cluster.ray
    engine_actor = ray.remote(num_cpus=ENGINE_ACTOR_CPUS)(EngineCoreActor)
    actors = [engine_actor.remote() for _ in range(size)]
    try:
        wheres = ray.get([actor.where.remote() for actor in actors],
                         timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"Ray did not place the {size} engine actors within "
                           f"{PLACEMENT_TIMEOUT_S:.0f} s (each needs {ENGINE_ACTOR_CPUS} free "
                           "CPU on a node)") from None
    return [PlacedEngine(rank, actor, pid, host)
            for rank, (actor, (pid, host)) in enumerate(zip(actors, wheres))]


def local_layout(hosts: list[str]) -> list[tuple[int, int]]:
    """(engines on its host, its index among them) of each engine, in rank order."""
    return [(hosts.count(host), hosts[:rank].count(host)) for rank, host in enumerate(hosts)]


def engine_config_on_ray(config: EngineConfig, placed: list[PlacedEngine],
                         rank: int) -> EngineConfig:
    """Engine `rank`'s configuration, with its place among the engines on its machine."""
    size_local, rank_local = local_layout([engine.host for engine in placed])[rank]
    engine = engine_config_for_rank(config, rank)
    return msgspec.structs.replace(engine, parallel=msgspec.structs.replace(
        engine.parallel, data_parallel_size_local=size_local,
        data_parallel_rank_local=rank_local))


def run_engine_actor(cluster: RayCluster, engine: PlacedEngine, config_bytes: bytes,
                     input_addr: str | list[str], output_addr: str | list[str],
                     heartbeat_addr: str | list[str]) -> RayActorHandle:
    """Start a placed engine's `run`, connecting to the given addresses (one front end's,
    or lists of them, one per API server). The variables forwarded now reach it too (the
    gc-stats folder of this engine is set just around this call)."""
    run_ref = engine.actor.run.remote(config_bytes, input_addr, output_addr, heartbeat_addr,
                                      forwarded_env())
    return RayActorHandle(cluster.ray, engine.actor, f"data-parallel engine {engine.rank}",
                          run_ref, engine.pid, engine.host)


class RayEngine:
    """EngineConnection.start's launcher for one placed engine actor."""

    def __init__(self, cluster: RayCluster, engine: PlacedEngine, host: str) -> None:
        self.cluster = cluster
        self.engine = engine
        self.host = host  # where this front end listens
        self.handle: RayActorHandle | None = None

    def addresses(self, ipc_dir: str) -> tuple[str, str, str]:
        return (f"tcp://{self.host}:*",) * 3  # each binds a free port

    def start(self, config_bytes: bytes, input_addr: str, output_addr: str,
              heartbeat_addr: str) -> RayActorHandle:
        self.handle = run_engine_actor(self.cluster, self.engine, config_bytes, input_addr,
                                       output_addr, heartbeat_addr)
        return self.handle


async def start_ray_engines(config: EngineConfig, startup_timeout_s: float
                            ) -> tuple[RayCluster, list[EngineConnection]]:
    """Join the cluster, place every engine and start them all at once (see launch.start_all:
    if one cannot start, the others are stopped); the cluster, to leave at shutdown (which
    ends the actors it still holds).

    1. Placement: one actor per engine, each asking Ray for one CPU; once Ray has placed them
       all, their pids and hosts say which engines share a machine, and each engine's config
       gets its local index and count there (vLLM's data_parallel_rank_local / _size_local),
       from which its workers take their device and their share of the machine's cores.
    2. Run: each starts through `EngineConnection.start` with `RayEngine` as the launcher:
       the connection binds its three ZMQ sockets on TCP instead of ipc, and the actor's `run`
       connects to them from wherever Ray put it. From the handshake on, it is an engine
       connection like any other, and the engine client balances over them.
    """
    # In a thread: joining takes seconds, and Ray sets no signal handler off the main
    # thread (the server's own SIGTERM handling, the drain, stays).
    cluster = await asyncio.to_thread(RayCluster.join)
    host = config.parallel.data_parallel_address or cluster.node_ip
    try:
        placed = await asyncio.to_thread(place_engine_actors, cluster,
                                         config.parallel.data_parallel_size)
        connections = await start_all([EngineConnection.start(
            engine_config_on_ray(config, placed, engine.rank), RayEngine(cluster, engine, host),
            startup_timeout_s, engine.rank) for engine in placed])
    except BaseException:
        await asyncio.to_thread(cluster.leave)
        raise
    for connection, where in zip(connections, placed):
        if where.host != socket.gethostname():
            connection.forget_remote_processes()
    logger.info("Data parallel on Ray: the engine cores are actors (%s), reaching this front "
                "end at %s.", ", ".join(f"engine {e.rank} pid {e.pid} on {e.host}"
                                        for e in placed), host)
    return cluster, connections


# ---------------------------------------------------------------- several API servers
@dataclass(frozen=True)
class EngineActorLink:
    """What one API server (of `--api-server-count N`) needs of one engine actor that the
    supervisor placed: this API server's three TCP addresses (input, output, heartbeat),
    the actor's pid and whether it runs on this host, and the read end of the supervisor's
    death notice (a pipe that reaches EOF once the supervisor saw the actor end: an API
    server cannot watch an actor's process itself)."""

    addresses: tuple[str, str, str]
    pid: int
    is_on_this_host: bool
    death_notice: Connection


class EngineActorsForApiServers:
    """The supervisor's side: every engine core placed as an actor, connected to a triple of
    TCP addresses per API server (free ports picked here; each API server binds its own),
    and one death-notice pipe per engine."""

    def __init__(self, config: EngineConfig, num_api_servers: int) -> None:
        self.cluster = RayCluster.join()
        host = config.parallel.data_parallel_address or self.cluster.node_ip
        size = config.parallel.data_parallel_size
        free = iter(_free_tcp_addresses(host, num_api_servers * size))
        #: [API server][engine] -> (input, output, heartbeat)
        self.addresses = [[next(free) for _ in range(size)] for _ in range(num_api_servers)]
        placed = place_engine_actors(self.cluster, size)
        self.handles = [run_engine_actor(
            self.cluster, engine,
            msgspec.msgpack.encode(engine_config_on_ray(config, placed, engine.rank)),
            *self._engine_addresses(engine.rank)) for engine in placed]
        self._notices = [multiprocessing.Pipe(duplex=False) for _ in self.handles]

    def _engine_addresses(self, rank: int) -> tuple[list[str], list[str], list[str]]:
        """Engine `rank`'s inputs, outputs and heartbeats: one of each per API server."""
        triples = [per_api_server[rank] for per_api_server in self.addresses]
        return [t[0] for t in triples], [t[1] for t in triples], [t[2] for t in triples]

    def links(self, api_server: int) -> tuple[EngineActorLink, ...]:
        return tuple(EngineActorLink(self.addresses[api_server][rank], handle.pid,
                                     handle.is_on_this_host, notice[0])
                     for rank, (handle, notice) in enumerate(zip(self.handles, self._notices)))

    def notify_death(self, rank: int) -> None:
        """Tell every API server that engine `rank` ended (they fail their requests)."""
        self._notices[rank][1].close()

    def close(self) -> None:
        for rank in range(len(self._notices)):
            self.notify_death(rank)
        self.cluster.leave()


async def connect_engine_actors(links: tuple[EngineActorLink, ...], server_dir: str,
                                startup_timeout_s: float) -> list[EngineConnection]:
    """An API server's connections to the supervisor's engine actors."""
    connections = await start_all([EngineConnection.connect(
        link.addresses, EngineNoticeHandle(link.death_notice, link.pid), startup_timeout_s,
        rank) for rank, link in enumerate(links)])
    for connection, link in zip(connections, links):
        connection.gc_stats_dir = server_dir  # the supervisor's folder (local actors write there)
        if not link.is_on_this_host:
            connection.forget_remote_processes()
    return connections


def _free_tcp_addresses(host: str, count: int) -> list[tuple[str, str, str]]:
    """`count` triples of TCP addresses at `host` on ports free right now, all different
    (the probes are held open together); an API server binds them a moment later, as
    with_master_port's rendezvous port is bound."""
    with contextlib.ExitStack() as probes:
        ports = []
        for _ in range(3 * count):
            probe = probes.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            probe.bind((host, 0))
            ports.append(probe.getsockname()[1])
    addresses = [f"tcp://{host}:{port}" for port in ports]
    return [(addresses[i], addresses[i + 1], addresses[i + 2]) for i in range(0, 3 * count, 3)]
