"""Helper processes for work that can run away (used by the API server, which renders
requests' own chat templates in them, and by the engine core, which trial-compiles
grammars in them).

A Python thread cannot be stopped, and neither can a C++ call it made; a process can. So
a job that might run for minutes or take gigabytes runs in a helper process with a time
limit per job and a memory limit per helper (`HelperPool`). Jobs and results cross as
msgpack: plain data both ways, so a helper subverted by its input cannot make the parent
run code by what it answers.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing
import os
import queue
import resource
import signal
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec

from gateway.logger import init_logger

logger = init_logger(__name__)

#: A helper's own start-up (an interpreter, imports) is not counted against a job's limit.
STARTUP_TIMEOUT_S = 300.0
_POLL_S = 0.05
_PARENT_CHECK_S = 0.5
_MIB = 1024 * 1024
_M_ARENA_MAX = -8  # glibc's mallopt parameter
_preloads: set[str] = set()  # every pool's, for the one fork server of this process


class HelperLimitError(Exception):
    """A job stopped by a limit: `limit` is "time" or "memory" (or "cancelled");
    `seconds`: how long it had run."""

    def __init__(self, limit: str, message: str, seconds: float = 0.0) -> None:
        super().__init__(message)
        self.limit = limit
        self.seconds = seconds


class HelperJobError(Exception):
    """The job raised in the helper: `kind` is the exception's class name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Helper:
    """One helper process and its pipes (None while not started)."""

    def __init__(self, module: str, arg: Any, memory_bytes: int | None, name: str) -> None:
        self.module, self.arg, self.memory_bytes, self.name = module, arg, memory_bytes, name
        self.process: BaseProcess | None = None
        self.connection: Connection | None = None
        self.closed = False
        self._lock = threading.Lock()  # start and kill, from the pool's threads

    def ensure_started(self) -> None:
        """Start the helper unless it runs; wait for it to be ready (not under the lock, so
        that `kill` never waits for a start-up)."""
        with self._lock:
            if self.closed:
                raise RuntimeError(f"the {self.name} helpers were shut down")
            if self.process is not None and self.process.is_alive():
                return
            self._kill()
            reader = self._spawn()
        try:
            ready = reader.poll(STARTUP_TIMEOUT_S) and reader.recv_bytes()
        except (EOFError, OSError):
            ready = False
        if not ready:
            code = None if self.process is None else self.process.exitcode
            self.kill()
            raise RuntimeError(f"the {self.name} helper did not start (limit "
                               f"{STARTUP_TIMEOUT_S:.0f} s; exit status {code})")

    def _spawn(self) -> Connection:
        context = multiprocessing.get_context("forkserver")
        ours, theirs = context.Pipe()
        self.process = context.Process(target=serve, args=(self.module, theirs, self.name),
                                       name=f"gateway-{self.name}", daemon=True)
        self.process.start()
        theirs.close()
        self.connection = ours
        ours.send_bytes(msgspec.msgpack.encode([self.memory_bytes, self.arg]))
        return ours

    def run(self, job: Any, timeout_s: float | None, cancelled: threading.Event | None
            ) -> Any:
        connection = self.connection  # `kill` may drop it meanwhile
        if connection is None:
            raise RuntimeError(f"the {self.name} helper is not running")
        connection.send_bytes(msgspec.msgpack.encode(job))
        started = time.monotonic()
        while not connection.poll(_POLL_S):
            if cancelled is not None and cancelled.is_set():
                self.kill()
                raise HelperLimitError("cancelled", "the job was cancelled",
                                       time.monotonic() - started)
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                self.kill()
                raise HelperLimitError("time", f"it ran for more than {timeout_s:g} s",
                                       time.monotonic() - started)
            if self.process is None or not self.process.is_alive():
                break
        try:
            status, *payload = msgspec.msgpack.decode(connection.recv_bytes())
        except (EOFError, OSError, msgspec.DecodeError):
            code = None
            if self.process is not None:
                self.process.join(1.0)
                code = self.process.exitcode
            self.kill()
            raise HelperLimitError("memory", self._died(code),
                                   time.monotonic() - started) from None
        if status == "ok":
            return payload[0]
        kind, message = payload
        if kind == "MemoryError":
            self.kill()  # its heap may be fragmented at the cap: start afresh
            raise HelperLimitError("memory", self._died(None), time.monotonic() - started)
        raise HelperJobError(kind, message)

    def _died(self, code: int | None) -> str:
        limit = "" if self.memory_bytes is None else \
            f" (its memory limit is {self.memory_bytes // _MIB} MiB)"
        how = "" if code is None else f", exit status {code}"
        return f"it ran out of memory or crashed{limit}{how}"

    def kill(self, *, for_good: bool = False) -> None:
        with self._lock:
            self.closed = self.closed or for_good
            self._kill()

    def _kill(self) -> None:
        process, self.process = self.process, None
        connection, self.connection = self.connection, None
        if connection is not None:
            with contextlib.suppress(OSError):
                connection.close()
        if process is not None and process.pid is not None:  # (None: it never started)
            with contextlib.suppress(ProcessLookupError, ValueError):
                process.kill()
            process.join()


class HelperPool:
    """`size` helper processes running MODULE's job function, one job each at a time.

    - A time limit per job: past it the helper is killed (SIGKILL), the caller gets
      `HelperLimitError` with limit "time" at once, and a fresh helper starts in the
      background. A job whose `cancelled` event is set is stopped the same way.
    - A memory limit per helper: its address space is capped (RLIMIT_AS) at its size after
      start-up plus the limit, so a runaway allocation fails inside the helper (a MemoryError,
      or the helper dies: limit "memory") and never in the caller.
    - Helpers are forked by multiprocessing's fork server, a fresh interpreter (never a fork
      of the caller: no torch or CUDA state is inherited) that has imported `preload` once, so
      a killed helper whose imports are slow (xgrammar imports torch) is replaced at once.
    - A helper loads the general plugins (as every gateway process does), calls MODULE's
      `start_helper(arg)` once for the function each job is passed to, and exits when its
      parent is gone or its pipe closes.
    """

    def __init__(self, module: str, arg: Any = None, *, size: int = 2,
                 memory_bytes: int | None = None, name: str = "helper",
                 preload: Sequence[str] = ()) -> None:
        """`preload`: modules the fork server imports once, before the first helper."""
        _preloads.update(preload)
        multiprocessing.get_context("forkserver").set_forkserver_preload(sorted(_preloads))
        self._helpers = [_Helper(module, arg, memory_bytes, name) for _ in range(size)]
        self._idle: queue.Queue[_Helper] = queue.Queue()
        self._started = False
        self._lock = threading.Lock()
        atexit.register(self.close)  # before multiprocessing's own exit kills them

    def start(self) -> None:
        """Start the helpers in the background (the first job waits for one)."""
        with self._lock:
            if self._started:
                return
            self._started = True
        for helper in self._helpers:
            self._restart(helper)

    def run(self, job: Any, timeout_s: float | None = None,
            cancelled: threading.Event | None = None) -> Any:
        """The job's result (blocking; waiting for a free helper is not counted against
        `timeout_s`). HelperLimitError past a limit, HelperJobError when the job raised,
        RuntimeError when no helper can start."""
        self.start()
        helper = self._take(cancelled)
        try:
            helper.ensure_started()
            result = helper.run(job, timeout_s, cancelled)
        except HelperJobError:
            self._idle.put(helper)
            raise
        except BaseException:
            self._restart(helper)
            raise
        self._idle.put(helper)
        return result

    def _take(self, cancelled: threading.Event | None) -> _Helper:
        while True:
            try:
                return self._idle.get(timeout=_POLL_S)
            except queue.Empty:
                if cancelled is not None and cancelled.is_set():
                    raise HelperLimitError("cancelled", "the job was cancelled") from None

    def _restart(self, helper: _Helper) -> None:
        """Start `helper` afresh in a thread of its own, then make it available."""
        def restart() -> None:
            try:
                helper.ensure_started()
            except Exception as exc:  # the next job tries again, and says why it failed
                if not helper.closed:
                    logger.warning("A %s helper process did not start: %s", helper.name, exc)
            self._idle.put(helper)

        helper.kill()
        threading.Thread(target=restart, name=f"{helper.name}-start", daemon=True).start()

    def num_idle(self) -> int:
        """Helpers started and free for a job now."""
        return self._idle.qsize()

    def pids(self) -> list[int]:
        return [h.process.pid for h in self._helpers
                if h.process is not None and h.process.pid is not None]

    def close(self) -> None:
        for helper in self._helpers:
            helper.kill(for_good=True)


# ------------------------------------------------------------------ in the helper
def _end_with_parent(parent_pid: int) -> None:
    """Exit when the parent (the fork server, which ends with the process that started
    it) is gone, even in the middle of a job."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _cap_memory(memory_bytes: int | None) -> None:
    """Cap the address space at its size now plus `memory_bytes` (Linux)."""
    if memory_bytes is None:
        return
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                size = int(line.split()[1]) * 1024
                resource.setrlimit(resource.RLIMIT_AS,
                                   (size + memory_bytes, resource.RLIM_INFINITY))
                return


def serve(module: str, connection: Connection, role: str) -> None:
    """The helper's loop: set-up from the first message, then one job a message."""
    import importlib

    from gateway.plugins.general import load_general_plugins

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server; it ends us
    os.environ["GATEWAY_PROCESS_ROLE"] = role
    with contextlib.suppress(OSError, AttributeError):  # few arenas: RLIMIT_AS counts them
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, 2)
    _end_with_parent(os.getppid())
    memory_bytes, arg = msgspec.msgpack.decode(connection.recv_bytes())
    load_general_plugins()
    handle: Callable[[Any], Any] = importlib.import_module(module).start_helper(arg)
    _cap_memory(memory_bytes)
    connection.send_bytes(msgspec.msgpack.encode("ready"))
    while True:
        try:
            job = msgspec.msgpack.decode(connection.recv_bytes())
        except EOFError:
            return
        try:
            answer = ["ok", handle(job)]
        except MemoryError:
            answer = ["error", "MemoryError", "out of memory"]
        except Exception as exc:
            answer = ["error", type(exc).__name__, str(exc)]
        connection.send_bytes(msgspec.msgpack.encode(answer))
