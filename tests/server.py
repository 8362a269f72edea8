"""The real `gateway serve` in a subprocess on a free loopback port, for tests and benches.

    with ServerProcess(["/path/to/model", "--max-model-len", "512"], log_path=...) as server:
        httpx.get(server.url("/health"))

Start-up waits for GET /health to answer 200 (or fails with the log's tail when the process
exits or the timeout passes); the log (stdout and stderr) goes to a file. Stopping sends
SIGTERM to the server alone, as an operator would, waits for it, and reports any process
the server had started that outlived it (then kills those, so no test leaks a process).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx

STARTUP_TIMEOUT_S = 180.0
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_cannot_start(model: Path) -> str:
    """Run `gateway serve MODEL` expecting it to refuse: exit status 1, one `Cannot start:`
    line, no traceback and no engine core started. Returns that line."""
    process = subprocess.run(
        [sys.executable, "-m", "gateway.frontend.cli.main", "serve", str(model),
         "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    output = process.stdout + process.stderr
    lines = [line for line in output.splitlines() if "Cannot start:" in line]
    assert process.returncode == 1, output
    assert len(lines) == 1, output
    assert "Traceback" not in output and "Engine core" not in output, output
    return lines[0]


def poll_status(url: str, status: int, within_s: float) -> httpx.Response | None:
    """GET `url` every 50 ms until it answers `status` or `within_s` passes; the last
    response (None if none came)."""
    started = time.monotonic()
    response = None
    while time.monotonic() - started < within_s:
        response = httpx.get(url, timeout=5)
        if response.status_code == status:
            break
        time.sleep(0.05)
    return response


def descendant_pids(pid: int) -> set[int]:
    """Every live process below `pid` (children, their children, ...), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":  # a zombie has exited already
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def is_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def _own_session_dying_with_parent() -> None:
    """In the child before exec: a session of its own, so that a signal for its group (as
    Ctrl-C sends to a terminal's foreground group) reaches the server and its children but
    never the test process; and SIGTERM when the test process dies, so that a killed test
    run leaves no server behind (Linux prctl PR_SET_PDEATHSIG)."""
    os.setsid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class ServerProcess:
    """One `gateway serve` process (see the module docstring)."""

    def __init__(self, serve_args: Sequence[str], *, env: dict[str, str] | None = None,
                 log_path: Path | None = None, host: str = "127.0.0.1",
                 startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 python: str = sys.executable, scheme: str = "http",
                 client_options: dict[str, Any] | None = None) -> None:
        self.python = python  # the interpreter (of a venv) that runs the server
        self.scheme = scheme  # "https" with --ssl-* flags
        #: httpx options the readiness check needs (TLS: `verify`, `cert`).
        self.client_options = client_options or {}
        self.port = free_port()
        self.host = host
        self.serve_args = list(serve_args)
        self.env = dict(os.environ if env is None else env)
        self.log_path = log_path or Path(tempfile.mkstemp(prefix="gateway-serve-",
                                                          suffix=".log")[1])
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self.leftover_pids: set[int] = set()
        self.started_at = 0.0
        self.ready_after_s: float | None = None

    @property
    def command(self) -> list[str]:
        return [self.python, "-m", "gateway.frontend.cli.main", "serve",
                *self.serve_args, "--host", self.host, "--port", str(self.port)]

    def url(self, path: str = "") -> str:
        return f"{self.scheme}://{self.host}:{self.port}{path}"

    def start(self) -> Self:
        """Start the process and wait until /health answers 200."""
        with open(self.log_path, "wb") as log:
            self.started_at = time.monotonic()
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, preexec_fn=_own_session_dying_with_parent)  # noqa: PLW1509
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = self.started_at + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway serve exited with {self.process.returncode} "
                                   f"before it was ready:\n{self.log_tail()}")
            try:
                if httpx.get(self.url("/health"), timeout=2.0,
                             **self.client_options).status_code == 200:
                    self.ready_after_s = time.monotonic() - self.started_at
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"gateway serve was not ready after {self.startup_timeout_s} s:\n"
                           f"{self.log_tail()}")

    def wait_exit(self, timeout_s: float = 120.0) -> int:
        """Wait for a process that is expected to stop by itself; return its exit code."""
        assert self.process is not None
        return self.process.wait(timeout=timeout_s)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0, *,
             to_group: bool = False) -> int | None:
        """Send `sig` to the server alone (or, `to_group`, to it and every process it
        started, as Ctrl-C in a terminal does), wait for it, and return its exit code.
        Processes it started that are still alive after it exited are recorded in
        `leftover_pids` (and killed)."""
        if self.process is None:
            return None
        descendants = descendant_pids(self.process.pid)
        if self.process.poll() is None:
            if to_group:
                os.killpg(self.process.pid, sig)
            else:
                self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        deadline = time.monotonic() + 5.0  # children may need a moment after the parent
        while time.monotonic() < deadline and any(is_alive(p) for p in descendants):
            time.sleep(0.05)
        self.leftover_pids = {p for p in descendants if is_alive(p)}
        for pid in self.leftover_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.process.returncode

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, num_lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-num_lines:])

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()
