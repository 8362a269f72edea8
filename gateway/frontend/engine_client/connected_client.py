"""An engine client for an engine core that another process started.

Front-end process. With `gateway serve --api-server-count N`, the supervisor process spawns
the engine core, and each of the N API-server processes connects to it with
`ConnectedEngineClient.connect(...)`: it binds its own pair of ZMQ addresses (the engine
core connects to every pair; see gateway.engine.sockets) and a heartbeat address of its
own, waits for the handshake the engine sends to each front end, and from then on is the
same `EngineClient`, with the same liveness check (/health answers 503 on every API server
while the engine core is stalled).

Two things differ. The engine core is not this process's child, so its death is watched
through a pidfd (Linux) rather than a multiprocessing sentinel, with the same outcome
(in-flight requests fail at once, `is_dead`, the death listeners). And `shutdown()` only
closes this front end's sockets: the supervisor stops the engine core once every front end
has stopped.
"""

from __future__ import annotations

import asyncio
import os
import select
from typing import Any

import zmq
import zmq.asyncio

from gateway.config import EngineConfig
from gateway.frontend.engine_client.client import (
    EngineClient,
    EngineDeadError,
    EngineStartError,
    _await_handshake,
)
from gateway.models.info.paths import ModelInfo, read_model_info, resolve_model_path
from gateway.tokenizer import load_tokenizer


class EngineProcessHandle:
    """What the engine client reads of a `multiprocessing.Process`, for a process that is
    not this one's child: a pidfd is readable once the process has exited."""

    exitcode = "unknown"  # only the parent (the supervisor) can read it

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self.sentinel = os.pidfd_open(pid)
        except ProcessLookupError:
            raise EngineStartError(f"the engine core (pid {pid}) is not running") from None

    def is_alive(self) -> bool:
        return not select.select([self.sentinel], [], [], 0)[0]

    def join(self, timeout: float | None = None) -> None:
        select.select([self.sentinel], [], [], timeout)

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


class EngineNoticeHandle:
    """The same members, for an engine core that is a Ray actor: the supervisor watches the
    actor and closes its end of `notice` (a pipe) when the actor ends; the read end is then
    readable here (EOF), wherever the actor ran."""

    exitcode = "unknown"

    def __init__(self, notice: Any, pid: int) -> None:
        self.notice, self.pid = notice, pid
        self.sentinel = notice.fileno()

    def is_alive(self) -> bool:
        return not self.notice.poll(0)

    def join(self, timeout: float | None = None) -> None:
        self.notice.poll(timeout)

    def close(self) -> None:
        self.notice.close()


class ConnectedEngineClient(EngineClient):
    """The engine client of one of several API servers (see the module doc)."""

    @classmethod
    async def connect(cls, config: EngineConfig, input_addr: str, output_addr: str,
                      engine_pid: int, model_info: ModelInfo | None = None,
                      startup_timeout_s: float = 900.0, heartbeat_addr: str | None = None,
                      tokenizer: Any = None, engine_watch: Any = None
                      ) -> ConnectedEngineClient:
        """Bind this front end's addresses and return once the engine's handshake came.
        `engine_watch`: the supervisor's death notice of an engine core that is a Ray actor
        (EngineNoticeHandle), watched instead of the pid.

        Raises EngineStartError with the core's own message when it could not start."""
        path = resolve_model_path(config.model.model)
        if tokenizer is None:  # several engines (data parallel) share the caller's
            tokenizer = await asyncio.to_thread(load_tokenizer, path)
        if model_info is None:
            model_info = await asyncio.to_thread(read_model_info, str(path))
        process: Any = (EngineProcessHandle(engine_pid) if engine_watch is None
                        else EngineNoticeHandle(engine_watch, engine_pid))
        context = zmq.asyncio.Context()
        input_socket = context.socket(zmq.PUSH)
        input_socket.bind(input_addr)
        output_socket = context.socket(zmq.PULL)
        output_socket.bind(output_addr)
        heartbeat_socket = None
        if heartbeat_addr is not None:
            heartbeat_socket = context.socket(zmq.PULL)
            heartbeat_socket.bind(heartbeat_addr)
        try:
            handshake = await _await_handshake(output_socket, process, startup_timeout_s)
        except BaseException:
            context.destroy(linger=0)
            process.close()
            raise
        client = cls(config, tokenizer, handshake, process, context, input_socket,
                     output_socket, os.path.dirname(input_addr.removeprefix("ipc://")),
                     model_info, heartbeat_socket)
        client._watch()
        return client

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Close this front end's side; the engine core keeps running for the others (the
        supervisor stops it)."""
        if not self.is_dead:
            self.is_dead, self.dead_reason = True, "shut down"
        process: Any = self._process
        asyncio.get_running_loop().remove_reader(process.sentinel)
        for task in (self._output_task, self._liveness_task):
            if task is not None:
                task.cancel()
        self._fail_all(EngineDeadError("the server was shut down"))
        self._context.destroy(linger=0)
        process.close()
