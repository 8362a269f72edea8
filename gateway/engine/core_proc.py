"""The engine-core process shell: sockets, signals and the loop around EngineCore.

Imports nothing heavy at module level: the front end imports this module to name the
spawn target, and must not import torch.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import threading
import time
import traceback

import msgspec
import zmq

from gateway import envs, gc_stats
from gateway.config import ConfigurationError, EngineConfig
from gateway.engine.sockets import FrontEnds
from gateway.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineHandshake,
    EngineHeartbeat,
    Shutdown,
)

_IDLE_POLL_MS = 1000  # while idle, wait for input this long at a time
_PARENT_CHECK_S = 0.25  # the watcher thread checks this often that the front end lives
_ORPHAN_EXIT_S = 1.5  # after noticing, the core gets this long to stop cleanly, then exits
_SEND_TIMEOUT_MS = 500  # a blocked output send wakes this often to check the front end
HEARTBEAT_INTERVAL_S = 0.5  # the heartbeat thread sends the step counter this often


def run_engine_core(config_bytes: bytes, input_addr: str | list[str],
                    output_addr: str | list[str], parent_pid: int | None,
                    heartbeat_addr: str | list[str] | None = None) -> None:
    """Entry point of the spawned engine-core process (and of the engine-core Ray actor,
    `EngineCoreActor`, with `parent_pid` None).

    `input_addr` and `output_addr` are one front end's ZMQ addresses, or lists of them, one
    per API-server process (`--api-server-count`; see gateway.engine.sockets).

    1. Name the process and load the general plugins (before the executor is made).
    2. Build the EngineCore and answer the handshake (or send why it could not start).
    3. Loop: take input (blocking only while idle, checking the workers' health), step,
       send outputs. A dead worker ends the process with code 1.

    The front end's death (even by SIGKILL) ends the process within about 2 s, idle or
    busy: a watcher thread sees the parent pid change, signals the main thread, and exits
    the process outright if the main thread cannot stop in time (stuck in a collective);
    workers die with it (their parent-death signal). Sends to the front end time out, so
    none can block forever once nobody reads them.

    A heartbeat thread sends the number of completed steps to `heartbeat_addr` (one
    address, or one per front end) every `HEARTBEAT_INTERVAL_S`, so each front end can
    tell a live engine from a stuck one.

    As a Ray actor (`parent_pid` None) the process is Ray's: no parent to watch and no
    SIGTERM handler of its own; Ray ends the actor when its owner (the front end, or the
    supervisor of several API servers) dies.
    """
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    role = config.parallel.engine_role  # engine-core, or engine-core-dp<rank>
    os.environ["GATEWAY_PROCESS_ROLE"] = role
    envs.default_openmp_waiting()  # before torch loads; an operator's own policy wins
    from gateway.logger import init_logger
    from gateway.plugins import start_process
    from gateway.process_start import load_process_plugins

    start_process(role)
    gc_stats.publish()
    logger = init_logger("gateway.engine.core_proc")
    if parent_pid is not None:
        signal.signal(signal.SIGTERM, _exit_on_signal)
    context = zmq.Context()
    output_addrs = [output_addr] if isinstance(output_addr, str) else output_addr
    front_ends = FrontEnds(context, [input_addr] if isinstance(input_addr, str) else input_addr,
                           output_addrs, _SEND_TIMEOUT_MS)
    parent = ParentWatch(parent_pid, _ipc_folder(output_addrs[0])).start()
    send = functools.partial(_send, parent=parent)
    encoder = msgspec.msgpack.Encoder()
    try:
        load_process_plugins()
        from gateway.engine.core import EngineCore
        core = EngineCore(config)
    except SystemExit:  # a stop signal, or the front end died, during start-up
        context.destroy(linger=0)
        raise
    except BaseException as exc:
        logger.error("Engine core failed to start:%s", f" {exc}" if isinstance(
            exc, ConfigurationError) else f"\n{traceback.format_exc()}")
        front_ends.send_to_all(encoder.encode(_failed_handshake(exc)), send)
        front_ends.close(linger_ms=5000)  # term() waits for every socket to close
        context.term()
        raise SystemExit(1) from None
    front_ends.send_to_all(encoder.encode(core.handshake(os.getpid())), send)
    from gateway.executor import ExecutorDeadError
    heartbeat = Heartbeat(core, context, heartbeat_addr).start()
    try:
        _loop(core, front_ends, encoder, parent, heartbeat)
    except SystemExit:
        pass
    except ExecutorDeadError as exc:
        logger.error("The engine core stops: %s", exc)
        raise SystemExit(1) from None
    finally:
        heartbeat.stop()
        core.shutdown()
        context.destroy(linger=0)


def _loop(core, front_ends: FrontEnds,  # type: ignore[no-untyped-def]
          encoder: msgspec.msgpack.Encoder, parent: ParentWatch, heartbeat: Heartbeat
          ) -> None:
    was_busy = False
    while True:
        if parent.is_gone():
            return  # nothing to serve
        timeout = 0 if core.has_work() else _IDLE_POLL_MS
        if not front_ends.poller.poll(timeout) and timeout:
            core.check_health()  # a worker process that died while idle ends the core
        errors = []
        for message in front_ends.receive():
            if isinstance(message, EngineCoreOutput):  # refused by the routing itself
                errors.append(message)
            elif isinstance(message, EngineCoreRequest):
                error = core.add_request(message)
                if error is not None:
                    errors.append(error)
            elif isinstance(message, AbortRequests):
                core.abort_requests(message.request_ids, message.reason)
            elif isinstance(message, Shutdown):
                return
        busy = core.has_work()
        if busy:
            result = core.step()
            heartbeat.num_steps += 1
            result.outputs[:0] = errors
        elif errors or was_busy:  # say so once when the engine goes idle (stats drop to 0)
            result = core.make_outputs(errors)
        else:
            continue
        result.engine_index = core.config.parallel.data_parallel_rank
        if not front_ends.send(result, encoder.encode, functools.partial(_send, parent=parent)):
            return
        was_busy = busy


def _send(outputs: zmq.Socket, data: bytes, parent: ParentWatch) -> bool:
    """Send `data` to the front end, waiting while its queue is full; False once the front
    end is gone (a plain blocking send would wait forever for a dead reader)."""
    while True:
        try:
            outputs.send(data)
            return True
        except zmq.Again:
            if parent.is_gone():
                return False


class ParentWatch:
    """Whether the front end (`parent_pid`) is still this process's parent, and a daemon
    thread that ends the process soon after it is not: SIGTERM to itself first (the main
    thread stops the executor and its workers), then, `_ORPHAN_EXIT_S` later, an immediate
    exit. Noticing it logs once and removes the front end's IPC folder (nobody else will).
    `parent_pid` None (a Ray actor): never gone; Ray watches the owner instead."""

    def __init__(self, parent_pid: int | None, ipc_folder: str | None) -> None:
        self.parent_pid = parent_pid
        self.ipc_folder = ipc_folder
        self._noting = threading.Lock()  # held for good by the first to notice

    def is_gone(self) -> bool:
        if self.parent_pid is None or os.getppid() == self.parent_pid:
            return False
        if self._noting.acquire(blocking=False):
            from gateway.logger import init_logger
            init_logger("gateway.engine.core_proc").warning(
                "The front end (pid %d) is gone; the engine core (pid %d) exits.",
                self.parent_pid, os.getpid())
            if self.ipc_folder is not None:
                shutil.rmtree(self.ipc_folder, ignore_errors=True)
        return True

    def start(self) -> ParentWatch:
        if self.parent_pid is not None:
            threading.Thread(target=self._watch, name="gateway-parent-watch",
                             daemon=True).start()
        return self

    def _watch(self) -> None:
        while not self.is_gone():
            time.sleep(_PARENT_CHECK_S)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(_ORPHAN_EXIT_S)
        os._exit(1)


class Heartbeat:
    """A daemon thread sending `EngineHeartbeat` (the completed-step counter the main loop
    raises, and the requests the core holds) every `HEARTBEAT_INTERVAL_S` to every front
    end's heartbeat address, on sockets of its own (a zmq socket belongs to one thread):
    one PUSH per front end, since one PUSH connected to several addresses would deal the
    beats out in turn instead of sending each to all. A send that would block is dropped:
    the next one carries the same counter."""

    def __init__(self, core, context: zmq.Context,  # type: ignore[no-untyped-def]
                 address: str | list[str] | None) -> None:
        self.core = core
        self.addresses = [address] if isinstance(address, str) else list(address or [])
        self.num_steps = 0  # raised by the main loop after each step
        self._context = context
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        if self.addresses:
            self._thread = threading.Thread(target=self._run, name="gateway-heartbeat",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * HEARTBEAT_INTERVAL_S)

    def _run(self) -> None:
        sockets = []
        encoder = msgspec.msgpack.Encoder()
        try:
            for address in self.addresses:
                socket = self._context.socket(zmq.PUSH)
                socket.setsockopt(zmq.LINGER, 0)
                socket.setsockopt(zmq.SNDHWM, 4)  # nobody needs old beats
                socket.connect(address)
                sockets.append(socket)
            while not self._stopped.wait(HEARTBEAT_INTERVAL_S):
                data = encoder.encode(EngineHeartbeat(
                    self.num_steps, len(self.core.scheduler.requests), time.time()))
                for socket in sockets:
                    try:
                        socket.send(data, zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # that front end is not reading: its next beat will do
        except zmq.ContextTerminated:
            return
        finally:
            for socket in sockets:
                socket.close(linger=0)


class EngineCoreActor:
    """The engine core as a Ray actor (`--data-parallel-backend ray`; placed by
    gateway.frontend.engine_client.ray_engines, which decorates this class with
    `ray.remote`, so importing it needs no Ray). `run` is `run_engine_core` in the actor's
    process, on the front end's TCP addresses, and lasts as long as the engine serves."""

    def where(self) -> tuple[int, str]:
        """This actor's pid and host name."""
        return os.getpid(), socket.gethostname()

    def run(self, config_bytes: bytes, input_addr: str | list[str],
            output_addr: str | list[str], heartbeat_addr: str | list[str],
            env: dict[str, str]) -> int:
        """Serve until the front end says Shutdown; the exit code a process would have.
        `env`: the front end's variables as they are when this engine starts (its
        gc-stats folder among them), set here before anything reads them."""
        os.environ.update(env)
        try:
            run_engine_core(config_bytes, input_addr, output_addr, None, heartbeat_addr)
        except SystemExit as exc:  # as a process's exit code, not an exit of Ray's worker
            return exc.code if isinstance(exc.code, int) else 1
        return 0


def _ipc_folder(address: str) -> str | None:
    """The folder of an `ipc://FOLDER/NAME` address (the front end's private one)."""
    if not address.startswith("ipc://"):
        return None
    return os.path.dirname(address[len("ipc://"):]) or None


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _failed_handshake(exc: BaseException) -> EngineHandshake:
    return EngineHandshake(supported_tasks=[], max_model_len=0, num_kv_blocks=0, block_size=0,
                           eos_token_ids=[], vocab_size=0, plugin_reports=[], pid=os.getpid(),
                           error=f"{type(exc).__name__}: {exc}")
