"""One of the N API-server processes of `gateway serve --api-server-count N`.

Front-end process, spawned by the supervisor (gateway.frontend.scaling.supervisor) with the
listening socket it bound, which every API server accepts on. Each runs the same `serve()`
as a single server (one app, the endpoint plugins loaded here by the same rules, their
`init_state` run here), with three differences, all carried by its `ApiServerRole`:

1. Its engine client connects to the engine core the supervisor started (one set of ZMQ
   addresses per API server) instead of spawning one; with `--data-parallel-size M`, to
   each of the M engine cores, behind one DataParallelEngineClient that balances this API
   server's requests over all of them on the load every engine reports to every API server.
2. Only API server 0 runs the stat loggers (logging, Prometheus engine metrics, plugins):
   each engine core sends the whole engine's iteration stats to it alone, so each token is
   counted once and the periodic stats line is logged once. Every API server counts its own
   HTTP requests; /metrics on any of them renders the files of all (prometheus_client's
   multiprocess mode).
3. It publishes its plugin load report into the shared folder and reads the others', so
   /v1/plugins on any API server lists every process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import signal
import socket
from dataclasses import dataclass
from typing import Any

from gateway.config import EngineConfig
from gateway.frontend.engine_client.connected_client import ConnectedEngineClient
from gateway.frontend.engine_client.dp_client import (
    AnyEngineClient,
    DataParallelEngineClient,
    engine_config_for_rank,
    start_all,
)
from gateway.frontend.scaling.shared_dir import ServerDir
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
    engine_links: tuple[Any, ...] = ()

    @property
    def name(self) -> str:
        return f"api-server-{self.index}"

    @property
    def runs_stat_loggers(self) -> bool:
        return self.index == STATS_API_SERVER

    async def connect_engine(self, config: EngineConfig, model_info: ModelInfo | None
                             ) -> AnyEngineClient:
        """This API server's engine client: one engine core's, or (data parallel) one over
        every engine core, which all share one tokenizer."""
        folder = ServerDir(self.server_dir)
        tokenizer = await asyncio.to_thread(load_tokenizer,
                                            resolve_model_path(config.model.model))
        if self.engine_links:
            from gateway.frontend.engine_client.ray_engines import connect_engine_actors

            return DataParallelEngineClient(config, await connect_engine_actors(
                config, self.engine_links, self.server_dir, model_info, tokenizer))
        engines = await start_all([ConnectedEngineClient.connect(
            engine_config_for_rank(config, rank), folder.input_address(self.index, rank),
            folder.output_address(self.index, rank), pid, model_info=model_info,
            heartbeat_addr=folder.heartbeat_address(self.index, rank), tokenizer=tokenizer)
            for rank, pid in enumerate(self.engine_pids)])
        if len(engines) == 1:
            return engines[0]
        return DataParallelEngineClient(config, engines)

    def attach(self, app: Any) -> None:
        """Let /v1/plugins and the plugin and process metrics see the other processes, and
        keep this process's report published (call in the running event loop)."""
        folder = ServerDir(self.server_dir)
        app.state.peer_plugin_reports = folder.peer_records
        app.state.peer_process_pids = folder.peer_pids
        app.state.publish_plugin_report = folder.publish_report
        app.state.publish_reports_task = asyncio.get_running_loop().create_task(
            _keep_published(folder))


async def _keep_published(folder: ServerDir) -> None:
    published = None
    while True:
        current = repr(load_report().to_dicts())
        if current != published:
            with contextlib.suppress(OSError):  # the folder is gone: the server is stopping
                folder.publish_report()
                published = current
        await asyncio.sleep(_REPORT_REFRESH_S)


def run_api_server_proc(role: ApiServerRole, args: argparse.Namespace, config: EngineConfig,
                        sock: socket.socket) -> None:
    """Entry point of a spawned API-server process: name it, die with the supervisor, load
    the general plugins (rule 4: every process), then serve on the shared socket."""
    os.environ["GATEWAY_PROCESS_ROLE"] = role.name
    start_process(role.name)
    set_log_format(args.log_format)
    _die_with_parent()
    try:
        load_process_plugins()
    except PluginError as exc:
        logger.error("%s", exc)
        raise SystemExit(1) from None
    from gateway.frontend.cli.serve import serve

    with sock:
        raise SystemExit(asyncio.run(serve(args, config, sock, front_end=role)))


def _die_with_parent() -> None:
    """SIGTERM when the supervisor dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG): an
    API server never serves without the supervisor that would stop the others."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
