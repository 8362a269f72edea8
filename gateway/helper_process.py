"""Helper processes for work that can run away (shared: the front end renders requests'
own chat templates in them, the engine core trial-compiles grammars in them).

A Python thread cannot be stopped, and neither can a C++ call it made; a process can. So a
job that might run for minutes or take gigabytes runs in a helper process:

- a time limit per job: past it the helper is killed (SIGKILL), the caller gets
  `HelperLimitError` with limit "time" at once, and a fresh helper starts in the
  background;
- a memory limit per helper: its address space is capped (RLIMIT_AS) at its size after
  start-up plus the limit, so a runaway allocation fails inside the helper (a MemoryError,
  or the helper dies: limit "memory") and never in the caller;
- cancelling: a job whose `cancelled` event is set is stopped the same way;
- a helper exits when its parent is gone (a thread of its own watches) or its pipe
  closes.

A helper runs `python -m gateway.helper_process MODULE READ_FD WRITE_FD`: it loads the
general plugins (as every gateway process does), calls MODULE's `start_helper(arg)` once
for the function each job is passed to, and serves jobs until its pipe closes. Jobs and
results cross as msgpack (plain data both ways: a helper that was subverted by its input
cannot make the parent run code by what it answers).
"""

from __future__ import annotations

import contextlib
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from gateway.logger import init_logger

logger = init_logger(__name__)

#: A helper's own start-up (an interpreter, imports) is not counted against a job's limit.
STARTUP_TIMEOUT_S = 300.0
_POLL_S = 0.05
_PARENT_CHECK_S = 0.5
_MIB = 1024 * 1024


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
        self.process: subprocess.Popen[bytes] | None = None
        self.to_helper: Connection | None = None
        self.from_helper: Connection | None = None
        self.closed = False
        self._lock = threading.Lock()  # start and kill, from the pool's threads

    def ensure_started(self) -> None:
        """Start the helper unless it runs; wait for it to be ready (not under the lock, so
        that `kill` never waits for a start-up)."""
        with self._lock:
            if self.closed:
                raise RuntimeError(f"the {self.name} helpers were shut down")
            if self.process is not None and self.process.poll() is None:
                return
            self._kill()
            reader = self._spawn()
        try:
            ready = reader.poll(STARTUP_TIMEOUT_S) and reader.recv_bytes()
        except (EOFError, OSError):
            ready = False
        if not ready:
            code = None if self.process is None else self.process.poll()
            self.kill()
            raise RuntimeError(f"the {self.name} helper did not start (limit "
                               f"{STARTUP_TIMEOUT_S:.0f} s; exit status {code})")

    def _spawn(self) -> Connection:
        helper_reads, parent_writes = os.pipe()
        parent_reads, helper_writes = os.pipe()
        env = dict(os.environ, MALLOC_ARENA_MAX="2",  # few arenas: RLIMIT_AS counts them
                   GATEWAY_PROCESS_ROLE=self.name)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway.helper_process", self.module, str(helper_reads),
             str(helper_writes)], pass_fds=(helper_reads, helper_writes), env=env,
            stdin=subprocess.DEVNULL, close_fds=True)
        os.close(helper_reads)
        os.close(helper_writes)
        self.to_helper, self.from_helper = Connection(parent_writes), Connection(parent_reads)
        self.to_helper.send_bytes(msgspec.msgpack.encode(
            [os.getpid(), self.memory_bytes, self.arg]))
        return self.from_helper

    def run(self, job: Any, timeout_s: float | None, cancelled: threading.Event | None
            ) -> Any:
        writer, reader = self.to_helper, self.from_helper  # `kill` may drop them meanwhile
        if writer is None or reader is None:
            raise RuntimeError(f"the {self.name} helper is not running")
        writer.send_bytes(msgspec.msgpack.encode(job))
        started = time.monotonic()
        while not reader.poll(_POLL_S):
            if cancelled is not None and cancelled.is_set():
                self.kill()
                raise HelperLimitError("cancelled", "the job was cancelled",
                                       time.monotonic() - started)
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                self.kill()
                raise HelperLimitError("time", f"it ran for more than {timeout_s:g} s",
                                       time.monotonic() - started)
            if self.process is None or self.process.poll() is not None:
                break
        try:
            status, *payload = msgspec.msgpack.decode(reader.recv_bytes())
        except (EOFError, OSError, msgspec.DecodeError):
            code = None if self.process is None else self.process.wait()
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
        for connection in (self.to_helper, self.from_helper):
            if connection is not None:
                with contextlib.suppress(OSError):
                    connection.close()
        self.to_helper = self.from_helper = None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait()


class HelperPool:
    """`size` helper processes running MODULE's job function, one job each at a time."""

    def __init__(self, module: str, arg: Any = None, *, size: int = 2,
                 memory_bytes: int | None = None, name: str = "helper") -> None:
        self._helpers = [_Helper(module, arg, memory_bytes, name) for _ in range(size)]
        self._idle: queue.Queue[_Helper] = queue.Queue()
        self._started = False
        self._lock = threading.Lock()

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
        return [h.process.pid for h in self._helpers if h.process is not None]

    def close(self) -> None:
        for helper in self._helpers:
            helper.kill(for_good=True)


# ------------------------------------------------------------------ in the helper
def _end_with_parent(parent_pid: int) -> None:
    """Exit when the parent is gone, even in the middle of a job. (Not PR_SET_PDEATHSIG:
    it fires when the *thread* that started the helper ends, and the pool starts helpers
    from short-lived threads.)"""
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


def serve(module: str, reader: Connection, writer: Connection) -> None:
    """The helper's loop: set-up from the first message, then one job a message."""
    import importlib

    from gateway.plugins.general import load_general_plugins

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server; it ends us
    parent_pid, memory_bytes, arg = msgspec.msgpack.decode(reader.recv_bytes())
    _end_with_parent(parent_pid)
    load_general_plugins()
    handle: Callable[[Any], Any] = importlib.import_module(module).start_helper(arg)
    _cap_memory(memory_bytes)
    writer.send_bytes(msgspec.msgpack.encode("ready"))
    while True:
        try:
            job = msgspec.msgpack.decode(reader.recv_bytes())
        except EOFError:
            return
        try:
            answer = ["ok", handle(job)]
        except MemoryError:
            answer = ["error", "MemoryError", "out of memory"]
        except Exception as exc:
            answer = ["error", type(exc).__name__, str(exc)]
        writer.send_bytes(msgspec.msgpack.encode(answer))


if __name__ == "__main__":
    serve(sys.argv[1], Connection(int(sys.argv[2])), Connection(int(sys.argv[3])))
