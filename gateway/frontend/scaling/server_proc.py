"""One of the N API-server processes of `gateway serve --api-server-count N`, spawned by the
supervisor with the listening socket it bound.

Each runs the same `serve()` (gateway.frontend.server) as a single server, with its own
endpoint plugins, and three differences carried by its `ApiServerRole`: its engine client
connects to the engine core(s) the supervisor started, balancing over all of them; only
API server 0 runs the stat loggers (each engine sends it the whole engine's iteration
stats, so each token is counted once), while every API server counts its own HTTP
requests and /metrics on any renders all (prometheus_client's multiprocess mode); and it
publishes its plugin load report into the shared folder and reads the others'.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
from dataclasses import dataclass

from gateway.config import EngineConfig
from gateway.frontend.engine_client.client import AsyncEngineClient, ClientOptions
from gateway.frontend.engine_client.connection import (
    DEFAULT_STARTUP_TIMEOUT_S,
    EngineConnection,
    EngineProcessHandle,
)
from gateway.frontend.engine_client.launch import start_all
from gateway.frontend.engine_client.ray_engines import EngineActorLink, connect_engine_actors
from gateway.frontend.scaling.shared_dir import ServerDir
from gateway.frontend.server import serve
from gateway.frontend.server_config import ServerConfig
from gateway.logger import init_logger, set_log_format
from gateway.models.info.paths import ModelInfo, resolve_model_path
from gateway.plugins import PluginError, load_report, start_process
from gateway.process_start import load_process_plugins
from gateway.tokenizer import load_tokenizer

logger = init_logger("gateway.serve")

#: The API server that receives the engine's iteration stats (the engine core's
#: gateway.engine.sockets.STATS_CLIENT; the two processes share no module for it).
STATS_API_SERVER = 0
_REPORT_REFRESH_S = 1.0  # how often a changed load report is published again
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ApiServerRole:
    """Which API server this process is, and where its peers and the engine cores are."""

    index: int
    count: int
    server_dir: str
    engine_pids: tuple[int, ...]  # one per data-parallel rank
    #: With --data-parallel-backend ray: one link per engine actor (its TCP addresses for
    #: this API server, its death notice); empty: the engines are the supervisor's children.
    engine_links: tuple[EngineActorLink, ...] = ()

    @property
    def name(self) -> str:
        return f"api-server-{self.index}"

    @property
    def runs_stat_loggers(self) -> bool:
        return self.index == STATS_API_SERVER

    async def connect_engine(self, config: EngineConfig, model_info: ModelInfo,
                             options: ClientOptions) -> AsyncEngineClient:
        """This API server's engine client over every engine core the supervisor started
        (one, or one per data-parallel rank)."""
        tokenizer = await asyncio.to_thread(load_tokenizer,
                                            resolve_model_path(config.model.model))
        if self.engine_links:
            connections = await connect_engine_actors(self.engine_links, self.server_dir,
                                                      DEFAULT_STARTUP_TIMEOUT_S)
        else:
            folder = ServerDir(self.server_dir)
            connections = await start_all([_connect(folder, self.index, rank, pid)
                                           for rank, pid in enumerate(self.engine_pids)])
        return AsyncEngineClient.from_connections(config, tokenizer, model_info, connections,
                                                  options=options)

    def peers(self) -> ServerDir:
        """Where /v1/plugins and the plugin and process metrics see the other processes."""
        return ServerDir(self.server_dir)

    def keep_report_published(self) -> asyncio.Task[None]:
        """Keep this process's load report published (call in the running event loop)."""
        return asyncio.get_running_loop().create_task(_keep_published(self.peers()))


async def _connect(folder: ServerDir, index: int, rank: int, pid: int) -> EngineConnection:
    """API server `index`'s connection to engine core `rank` (the supervisor's child)."""
    addresses = (folder.input_address(index, rank), folder.output_address(index, rank),
                 folder.heartbeat_address(index, rank))
    return await EngineConnection.connect(addresses, EngineProcessHandle(pid),
                                          DEFAULT_STARTUP_TIMEOUT_S, rank)


async def _keep_published(folder: ServerDir) -> None:
    published = None
    while True:
        current = repr(load_report().to_dicts())
        if current != published:
            with contextlib.suppress(OSError):  # the folder is gone: the server is stopping
                folder.publish_report()
                published = current
        await asyncio.sleep(_REPORT_REFRESH_S)


def run_api_server_proc(role: ApiServerRole, config: ServerConfig, sock: socket.socket) -> None:
    """Entry point of a spawned API-server process: name it, die with the supervisor, load
    the general plugins (rule 4: every process), then serve on the shared socket."""
    os.environ["GATEWAY_PROCESS_ROLE"] = role.name
    start_process(role.name)
    set_log_format(config.observability.log_format)
    _die_with_parent()
    try:
        load_process_plugins()
    except PluginError as exc:
        logger.error("%s", exc)
        raise SystemExit(1) from None
    with sock:
        raise SystemExit(asyncio.run(serve(config, sock, role)))


def _die_with_parent() -> None:
    """SIGTERM when the supervisor dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG): an
    API server never serves without the supervisor that would stop the others."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
