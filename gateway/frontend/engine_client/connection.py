"""One engine core's connection (API-server process; torch is never imported here): its
sockets, its output loop, its liveness. The engine client (client.py) owns the requests; a
connection moves their bytes, in order, at a constant cost each: past the socket's
high-water mark they wait in the connection's own queue, not in pyzmq's list of send
futures, which every completed send scanned whole.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import select
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from gateway import gc_stats
from gateway.config import EngineConfig
from gateway.frontend.engine_client.errors import EngineStartError
from gateway.frontend.engine_client.liveness import DEFAULT_STALL_THRESHOLD_S, EngineLiveness
from gateway.logger import init_logger
from gateway.messages import (
    EngineCoreOutputs,
    EngineHandshake,
    EngineHeartbeat,
    SchedulerStats,
    Shutdown,
)

logger = init_logger(__name__)

#: How long an engine core may take to load its model and answer its handshake.
DEFAULT_STARTUP_TIMEOUT_S = 900.0


class EngineProcess(Protocol):
    """What a connection reads of the engine core's process: the members of a
    `multiprocessing.Process` (a Ray actor's handle and a pidfd's have them too)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def sentinel(self) -> int: ...

    @property
    def exitcode(self) -> int | str | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...


class OwnedEngineProcess(EngineProcess, Protocol):
    """An engine core this process started, and so stops."""

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class WatchedEngineProcess(EngineProcess, Protocol):
    """An engine core another process started: only watched, then let go."""

    def close(self) -> None: ...


class EngineLauncher(Protocol):
    """How `EngineConnection.start` starts an engine core: the addresses its sockets bind
    (`tcp://HOST:*` picks a free port), then the engine core, connected to the bound
    addresses."""

    def addresses(self, ipc_dir: str) -> tuple[str, str, str]:
        """Input, output and heartbeat addresses to bind (`ipc_dir`: the connection's
        folder)."""
        ...

    def start(self, config_bytes: bytes, input_addr: str, output_addr: str,
              heartbeat_addr: str) -> OwnedEngineProcess: ...


OutputsSink = Callable[[int, EngineCoreOutputs], None]
DeathSink = Callable[[int], None]


class EngineConnection:
    """The sockets, loops and liveness of one engine core.

    `start(config, launcher)` starts an engine core (a spawned process, or a Ray actor through
    its launcher) and binds the three ZMQ sockets the core connects to; `connect(...)` binds
    them for an engine core another process started (one of several API servers). Either
    returns once the core's handshake came. Then `watch(on_outputs, on_death)` runs the output
    loop (each batch of outputs goes to `on_outputs`), the heartbeat loop (liveness.py) and
    watches the core's process: a multiprocessing sentinel for a child, a pidfd for another
    process's child, a pipe for a Ray actor. When it exits, `on_death` is called once.
    """

    def __init__(self, index: int, handshake: EngineHandshake, context: zmq.asyncio.Context,
                 input_socket: zmq.asyncio.Socket, output_socket: zmq.asyncio.Socket,
                 heartbeat_socket: zmq.asyncio.Socket | None, folder: str | None, *,
                 owned: OwnedEngineProcess | None = None,
                 watched: WatchedEngineProcess | None = None) -> None:
        """Exactly one of `owned` (an engine core this process started) and `watched`
        (another process's) is given."""
        #: The engine's data-parallel rank (0 with one engine).
        self.index = index
        self.handshake = handshake
        #: The server's processes on this host by role (engine core, local workers): pid.
        self.process_pids: dict[str, int] = dict(handshake.processes)
        #: Where those processes keep their garbage-collector counts (gateway/gc_stats.py).
        self.gc_stats_dir: str | None = folder
        self.latest_stats: SchedulerStats | None = None
        #: Set once the engine core's process exited (or the connection was shut down).
        self.dead_reason: str | None = None
        #: Whether the engine makes progress (its heartbeat); /health reads it.
        self.liveness = EngineLiveness(lambda: 0)
        process = owned if owned is not None else watched
        assert process is not None and (owned is None or watched is None)
        self._process: EngineProcess = process
        self._owned = owned
        self._watched = watched
        self._context = context
        self._input = input_socket
        # The same socket, sent to without futures (see `send_bytes`).
        self._input_now: zmq.Socket[bytes] = zmq.Socket.shadow(input_socket.underlying)
        self._outbox: deque[bytes] = deque()  # waiting for room in the socket, in order
        self._flusher: asyncio.Task[None] | None = None
        self._output = output_socket
        self._heartbeat = heartbeat_socket
        self._folder = folder
        self._encoder = msgspec.msgpack.Encoder()
        self._tasks: list[asyncio.Task[None]] = []
        self._on_death: DeathSink | None = None

    # ------------------------------------------------------------------ opening
    @classmethod
    async def start(cls, config: EngineConfig, launcher: EngineLauncher,
                    startup_timeout_s: float, index: int = 0) -> EngineConnection:
        """Start an engine core with `launcher` and return once its handshake came.

        Raises EngineStartError with the core's own message when it cannot start."""
        folder = tempfile.mkdtemp(prefix="gateway-ipc-")
        context = zmq.asyncio.Context()
        input_socket, output_socket, heartbeat_socket = (
            context.socket(zmq.PUSH), context.socket(zmq.PULL), context.socket(zmq.PULL))
        process = None
        try:
            addresses = [_bind(socket, address) for socket, address in zip(
                (input_socket, output_socket, heartbeat_socket), launcher.addresses(folder))]
            with gc_stats.shared_with_children(folder):  # python_gc_* of engine and workers
                process = launcher.start(msgspec.msgpack.encode(config), *addresses)
            handshake = await _await_handshake(output_socket, process, startup_timeout_s)
        except BaseException:
            if process is not None:
                _stop_process(process)
            context.destroy(linger=0)
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return cls(index, handshake, context, input_socket, output_socket, heartbeat_socket,
                   folder, owned=process)

    @classmethod
    async def connect(cls, addresses: tuple[str, str, str], process: WatchedEngineProcess,
                      startup_timeout_s: float, index: int = 0) -> EngineConnection:
        """Bind this front end's input, output and heartbeat `addresses` for an engine core
        another process started (`process`: how its end is seen) and return once its
        handshake came."""
        context = zmq.asyncio.Context()
        input_socket, output_socket, heartbeat_socket = (
            context.socket(zmq.PUSH), context.socket(zmq.PULL), context.socket(zmq.PULL))
        for socket, address in zip((input_socket, output_socket, heartbeat_socket),
                                   addresses):
            socket.bind(address)
        try:
            handshake = await _await_handshake(output_socket, process, startup_timeout_s)
        except BaseException:
            context.destroy(linger=0)
            process.close()
            raise
        folder = os.path.dirname(addresses[0].removeprefix("ipc://"))
        return cls(index, handshake, context, input_socket, output_socket, heartbeat_socket,
                   folder, watched=process)

    def watch(self, on_outputs: OutputsSink, on_death: DeathSink,
              num_pending: Callable[[], int],
              stall_threshold_s: float = DEFAULT_STALL_THRESHOLD_S) -> None:
        """Run the output and heartbeat loops and watch the engine core's process (call in
        the running event loop, once). `num_pending()`: the requests this front end has in
        flight on the engine, read by the liveness check."""
        loop = asyncio.get_running_loop()
        self._on_death = on_death
        self.liveness.num_pending = num_pending
        self.liveness.stall_threshold_s = stall_threshold_s
        loop.add_reader(self._process.sentinel, self._on_process_exit)
        self._tasks.append(loop.create_task(self._output_loop(on_outputs)))
        if self._heartbeat is not None:
            self._tasks.append(loop.create_task(self._liveness_loop()))

    # ------------------------------------------------------------------ facts
    @property
    def pid(self) -> int:
        return self.handshake.pid

    @property
    def owns_engine(self) -> bool:
        """Whether this process started the engine core (and so stops it)."""
        return self._owned is not None

    def forget_remote_processes(self) -> None:
        """An engine on another host: its pids mean nothing here (the process metrics read
        /proc, the gc stats a local folder), so they are not reported as this host's."""
        self.process_pids = {}
        self.gc_stats_dir = None

    # ------------------------------------------------------------------ sending
    def send(self, message: object) -> None:
        self.send_bytes(self._encoder.encode(message))

    def send_bytes(self, message: bytes) -> None:
        """Send now, or queue behind the messages already waiting for room; never waits, so
        an abort can be sent from a `finally` of a cancelled generator."""
        if not self._outbox:
            try:
                self._input_now.send(message, zmq.DONTWAIT)
                return
            except zmq.Again:
                pass
        self._outbox.append(message)
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        """Send the waiting messages as the socket has room, oldest first."""
        room = zmq.asyncio.Poller()
        room.register(self._input, zmq.POLLOUT)
        try:
            while self._outbox:
                await room.poll()
                while self._outbox:
                    try:
                        self._input_now.send(self._outbox[0], zmq.DONTWAIT)
                    except zmq.Again:
                        break
                    self._outbox.popleft()
        finally:
            self._flusher = None

    # ------------------------------------------------------------------ stopping
    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop watching and close the sockets. An engine core this process started is
        asked to stop first, and waited for (then killed); another's keeps running for the
        other front ends (the supervisor stops it)."""
        if self._owned is not None and self.dead_reason is None:
            # Not awaited: if the core already died (a signal to the whole process group),
            # the PUSH socket has no peer and an awaited send would wait forever.
            self.send(Shutdown())
        if self.dead_reason is None:
            self.dead_reason = "shut down"
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        if self._owned is not None:
            await asyncio.to_thread(_stop_process, self._owned, timeout_s)
        for task in [*self._tasks, *([self._flusher] if self._flusher else [])]:
            task.cancel()
        self._context.destroy(linger=0)
        if self._watched is not None:
            self._watched.close()
        elif self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    # ------------------------------------------------------------------ loops
    async def _output_loop(self, on_outputs: OutputsSink) -> None:
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        while True:
            outputs = decoder.decode(await self._output.recv())
            self.liveness.on_progress()
            if outputs.scheduler_stats is not None:
                self.latest_stats = load = outputs.scheduler_stats
                # Every front end's requests (several API servers): fresher than a beat.
                self.liveness.num_engine_requests = load.num_running_reqs + \
                    load.num_waiting_reqs
            on_outputs(self.index, outputs)

    async def _liveness_loop(self) -> None:
        assert self._heartbeat is not None
        decoder = msgspec.msgpack.Decoder(EngineHeartbeat)
        while True:
            interval_ms = int(self.liveness.check_interval_s * 1000)
            while await self._heartbeat.poll(timeout=interval_ms):
                self.liveness.on_heartbeat(decoder.decode(await self._heartbeat.recv()))
                interval_ms = 0  # take every queued beat, then check
            self.liveness.check()

    def _on_process_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        if self.dead_reason is not None:
            return
        self._process.join(timeout=1)  # the sentinel fires just before the exit is reapable
        self.dead_reason = f"the engine core (pid {self._process.pid}) exited with code " \
                           f"{self._process.exitcode}"
        if self._on_death is not None:
            self._on_death(self.index)


# ---------------------------------------------------------------- launchers and handles
class SpawnedEngine:
    """The default launcher: the engine core as a child process (spawn), on ipc
    addresses in the connection's private folder."""

    def addresses(self, ipc_dir: str) -> tuple[str, str, str]:
        return f"ipc://{ipc_dir}/input", f"ipc://{ipc_dir}/output", f"ipc://{ipc_dir}/heartbeat"

    def start(self, config_bytes: bytes, input_addr: str, output_addr: str,
              heartbeat_addr: str) -> OwnedEngineProcess:
        from gateway.engine.core_proc import run_engine_core  # light: imports no torch

        process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="gateway-engine-core",
            args=(config_bytes, input_addr, output_addr, os.getpid(), heartbeat_addr))
        process.start()
        return process


class EngineProcessHandle:
    """An engine core that is not this process's child (the supervisor's, with several API
    servers), watched through a pidfd (Linux): readable once the process has exited."""

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
    """The same members, for an engine core that is a Ray actor the supervisor placed: the
    supervisor watches the actor and closes its end of `notice` (a pipe) when the actor
    ends; the read end is then readable here (EOF), wherever the actor ran."""

    exitcode = "unknown"

    def __init__(self, notice: Connection, pid: int) -> None:
        self.notice, self.pid = notice, pid
        self.sentinel = notice.fileno()

    def is_alive(self) -> bool:
        return not self.notice.poll(0)

    def join(self, timeout: float | None = None) -> None:
        self.notice.poll(timeout)

    def close(self) -> None:
        self.notice.close()


# ---------------------------------------------------------------- helpers
def _bind(socket: zmq.asyncio.Socket, address: str) -> str:
    """Bind `socket` to `address`; the address bound (a `*` port resolved)."""
    try:
        socket.bind(address)
    except zmq.ZMQError as exc:  # e.g. --data-parallel-address is not this machine's
        raise EngineStartError(f"cannot listen for the engine core at {address}: {exc}") \
            from None
    return bytes(socket.getsockopt(zmq.LAST_ENDPOINT)).decode()


async def _await_handshake(socket: zmq.asyncio.Socket, process: EngineProcess,
                           timeout_s: float) -> EngineHandshake:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await socket.poll(timeout=200):
            handshake = msgspec.msgpack.decode(await socket.recv(), type=EngineHandshake)
            if handshake.error is not None:
                raise EngineStartError(handshake.error)
            return handshake
        if not process.is_alive():
            raise EngineStartError(f"the engine core exited with code {process.exitcode} "
                                   "during start-up (see its log above)")
    raise EngineStartError(f"the engine core did not answer within {timeout_s:.0f} s")


def _stop_process(process: OwnedEngineProcess, timeout_s: float = 10.0) -> None:
    process.join(timeout=timeout_s)
    if process.is_alive():
        process.terminate()
        process.join(timeout=5)
    if process.is_alive():
        process.kill()
        process.join()
