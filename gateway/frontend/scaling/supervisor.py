"""`gateway serve --api-server-count N` (N > 1): the supervisor of N API servers and the
engine core(s), run in the `gateway serve` process, which serves no HTTP itself (as
vLLM's; docs/scaling.md).

1. It checks the model path and the TLS files and binds the listening socket once; every
   API server inherits it (one accept queue, no SO_REUSEPORT).
2. It makes the shared folder (shared_dir.py) and spawns the engine core(s) (or places
   them on Ray) and the N API servers (server_proc.py).
3. It waits: on SIGTERM or SIGINT everything drains and stops, exit code 0; any API server
   or engine core that exits on its own stops the whole, exit code 1 (`run_api_servers`).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import time
from multiprocessing.connection import wait
from typing import Any

import msgspec

from gateway import gc_stats
from gateway.config import EngineConfig
from gateway.frontend import startup
from gateway.frontend.engine_client.launch import engine_config_for_rank
from gateway.frontend.engine_client.ray_engines import EngineActorsForApiServers
from gateway.frontend.scaling.server_proc import ApiServerRole, run_api_server_proc
from gateway.frontend.scaling.shared_dir import ServerDir
from gateway.frontend.server_config import ServerConfig
from gateway.logger import init_logger
from gateway.models.info.paths import read_model_info
from gateway.plugins import start_process

logger = init_logger("gateway.serve")

SUPERVISOR_ROLE = "supervisor"
_API_SERVER_STOP_S = 15.0  # an API server drains (5 s) and shuts down within this
_ENGINE_DEAD_WAIT_S = 10.0  # after the engine died, the API servers exit by themselves within
_ENGINE_STOP_S = 20.0  # the engine core stops (it waits for its workers) within this


class _StopRequested(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)


def run_api_servers(server_config: ServerConfig) -> int:
    """Serve with `api_server_count` API servers until stopped; the exit code.

    SIGTERM or SIGINT: every API server drains as a single server does, then the engine core
    stops; exit code 0. An API server that exits on its own: the others are stopped, then the
    engine; exit code 1. It is not restarted, so the server is never left half up and a
    supervisor above (systemd, Kubernetes) restarts the whole. An engine core that dies: the
    API servers fail their in-flight requests (on every engine), answer 503 on /health for a
    moment and exit; then the other engines are stopped, exit code 1.
    """
    config, count, http = server_config.engine, server_config.api_server_count, \
        server_config.http
    try:  # a missing model, a bad certificate, a port in use: one line now, not N later
        read_model_info(config.model.model)
        startup.check_tls(http)
        sock = startup.bind_socket(http.host, http.port)
    except (FileNotFoundError, startup.StartupError) as exc:
        logger.error("Cannot start: %s", exc)
        return 1
    start_process(SUPERVISOR_ROLE)
    folder = ServerDir.create()
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", folder.metrics_dir)
    folder.publish_report()
    engines: list[Any] = []
    api_servers: list[Any] = []
    actors = None
    try:
        if config.parallel.data_parallel_backend == "ray":
            # Before this process's stop signals are set: joining Ray sets its own
            # (gateway.frontend.engine_client.ray_engines).
            with gc_stats.shared_with_children(str(folder.path)):
                actors = EngineActorsForApiServers(config, count)
            engines.extend(actors.handles)
    except Exception as exc:
        logger.error("Cannot start the engine actors: %s", exc)
        sock.close()
        shutil.rmtree(folder.path, ignore_errors=True)
        return 1
    _on_stop_signals(_raise_stop)
    try:
        with sock:
            with gc_stats.shared_with_children(str(folder.path)):  # python_gc_* of each engine
                if actors is None:
                    engines.extend(_spawn_engine(config, folder, count, rank)
                                   for rank in range(config.parallel.data_parallel_size))
            api_servers.extend(_spawn_api_servers(server_config, folder, sock,
                                                  tuple(e.pid for e in engines), actors))
        logger.info("Supervising %d API servers (pids %s) on %s:%d and %s (pid %s).",
                    count, ", ".join(str(p.pid) for p in api_servers),
                    http.host, http.port, "the engine core" if len(engines) == 1 else
                    f"{len(engines)} data-parallel engine cores",
                    ", ".join(str(e.pid) for e in engines))
        return _supervise(engines, api_servers,
                          actors.notify_death if actors is not None else None)
    except _StopRequested as stop:
        logger.info("Received %s; stopping the API servers, then the engine core.", stop)
        return 0
    finally:
        _on_stop_signals(lambda signum, frame: logger.warning("Already shutting down."))
        _stop_all(engines, api_servers)
        if actors is not None:
            actors.close()
        shutil.rmtree(folder.path, ignore_errors=True)


def _spawn_engine(config: EngineConfig, folder: ServerDir, count: int, rank: int) -> Any:
    """Engine core `rank` (0 unless data parallel), connected to each of `count` API
    servers."""
    from gateway.engine.core_proc import run_engine_core  # light: imports no torch

    config = engine_config_for_rank(config, rank)
    servers = range(count)
    process = multiprocessing.get_context("spawn").Process(
        target=run_engine_core, name=f"gateway-{config.parallel.engine_role}",
        args=(msgspec.msgpack.encode(config), [folder.input_address(i, rank) for i in servers],
              [folder.output_address(i, rank) for i in servers], os.getpid(),
              [folder.heartbeat_address(i, rank) for i in servers]))
    process.start()
    return process


def _spawn_api_servers(config: ServerConfig, folder: ServerDir, sock: Any,
                       engine_pids: tuple[int, ...],
                       actors: EngineActorsForApiServers | None = None) -> list[Any]:
    spawn = multiprocessing.get_context("spawn")
    processes = []
    count = config.api_server_count
    for index in range(count):
        links = actors.links(index) if actors is not None else ()
        role = ApiServerRole(index, count, str(folder.path), engine_pids, links)
        process = spawn.Process(target=run_api_server_proc, name=f"gateway-{role.name}",
                                args=(role, config, sock))
        process.start()
        processes.append(process)
    return processes


def _supervise(engines: list[Any], api_servers: list[Any],
               notify_engine_death: Any = None) -> int:
    """Wait for the first process to exit and say what it means; the exit code."""
    ready = wait([*(e.sentinel for e in engines), *(p.sentinel for p in api_servers)])
    dead = [engine for engine in engines if engine.sentinel in ready]
    for engine in dead:
        engine.join()
        logger.error("The engine core %s(pid %d) exited with code %s; the API servers stop.",
                     "" if len(engines) == 1 else f"{engines.index(engine)} ", engine.pid,
                     engine.exitcode)
        if notify_engine_death is not None:
            notify_engine_death(engines.index(engine))
    if dead:
        _wait_all(api_servers, _ENGINE_DEAD_WAIT_S)
        return 1
    for index, process in enumerate(api_servers):
        if process.sentinel in ready:
            process.join()
            logger.error("API server %d (pid %d) exited with code %s; the server stops "
                         "(an API server is not restarted: the server is never left half "
                         "up).", index, process.pid, process.exitcode)
    return 1


def _stop_all(engines: list[Any], api_servers: list[Any]) -> None:
    """SIGTERM the API servers and wait for them to drain, then the engine core(s)."""
    for group, timeout_s in ((api_servers, _API_SERVER_STOP_S), (engines, _ENGINE_STOP_S)):
        live = [p for p in group if p.is_alive()]
        for process in live:
            process.terminate()
        _wait_all(live, timeout_s)
        for process in live:
            if process.is_alive():
                logger.error("%s (pid %d) did not stop within %.0f s; killing it.",
                             process.name, process.pid, timeout_s)
                process.kill()
            process.join()


def _wait_all(processes: list[Any], timeout_s: float) -> None:
    """Until every one of `processes` has exited, or `timeout_s` passed. Polled with
    `is_alive()` (waitpid), not the sentinels: an API server's sentinel was seen ready
    while the process was still finalising its interpreter."""
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)


def _raise_stop(signum: int, frame: object) -> None:
    raise _StopRequested(signum)


def _on_stop_signals(handler: Any) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
