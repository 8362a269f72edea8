"""End to end: connections that take without asking, against a real `gateway serve` started
with the usual soft limit of 1,024 open files.

- The soft limit is raised to the hard limit at start-up.
- 1,100 idle sockets and 400 clients sending their headers a byte at a time: /health and a
  completion still answer within 1 s; the slow ones get a 408 and are closed after the
  header timeout; a connection that never sends anything is closed after the keep-alive
  timeout.
- Requests beyond --limit-concurrency get an OpenAI-shaped 503 with Retry-After; /health
  and /metrics are never refused.
- With a hard limit of 1,024 too (the raise cannot help), accept errors are logged once per
  interval, not thousands of times a second, and the server serves again once the sockets
  are gone.

Every loop here is bounded by a deadline.
"""

from __future__ import annotations

import resource
import selectors
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.frontend.conftest import tiny_server
from tests.server import ServerProcess

pytestmark = pytest.mark.e2e

USUAL_SOFT_LIMIT = 1024
NUM_IDLE = 1100
NUM_SLOW = 400
HEADER_TIMEOUT_S = 3.0
KEEP_ALIVE_S = 6
LIMIT = 4
ANSWER_WITHIN_S = 1.0
# Runs `gateway ...` with RLIMIT_NOFILE set to (argv[1], argv[2] or the hard limit).
_WRAPPER = ("import os, resource, sys\n"
            "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
            "new_hard = hard if sys.argv[2] == 'hard' else int(sys.argv[2])\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), new_hard))\n"
            "os.execv(sys.executable, [sys.executable, '-m', 'gateway.frontend.cli.main',"
            " *sys.argv[3:]])\n")


class FdLimitedServer(ServerProcess):
    """A ServerProcess whose process starts with the given open-files limits."""

    def __init__(self, base: ServerProcess, soft: int, hard: int | None) -> None:
        super().__init__(base.serve_args, env=base.env, log_path=base.log_path)
        self.limits = (str(soft), "hard" if hard is None else str(hard))

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-c", _WRAPPER, *self.limits, *super().command[3:]]


def _open_files_limits(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-files line")


@pytest.fixture(scope="module", autouse=True)
def _enough_files_here():
    """This test process holds 1,500 sockets itself."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory, _enough_files_here):
    log = tmp_path_factory.mktemp("logs") / "limits-server.log"
    base = tiny_server(tiny_model, "--header-timeout", str(HEADER_TIMEOUT_S),
                       "--timeout-keep-alive", str(KEEP_ALIVE_S),
                       "--limit-concurrency", str(LIMIT), log_path=log)
    with FdLimitedServer(base, USUAL_SOFT_LIMIT, None) as server:
        yield server
    assert server.process.returncode == 0, server.log_tail()


def _connect(port: int, count: int) -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.setblocking(False)
        sockets.append(sock)
    return sockets


def _dribble(sockets: list[socket.socket], stop: threading.Event) -> None:
    """Send a request's headers a byte every 0.2 s, never finishing them."""
    for sock in sockets:
        sock.send(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    while not stop.wait(0.2):
        for sock in sockets:
            try:
                sock.send(b"a")
            except OSError:
                pass  # closed by the server: what should happen


def _answers_by(sockets: list[socket.socket], deadline: float) -> dict[int, bytes]:
    """What each socket received before it was closed (b"" when closed silently), for
    those the server closed by `deadline`."""
    received: dict[int, bytes] = {}
    with selectors.DefaultSelector() as selector:
        for index, sock in enumerate(sockets):
            selector.register(sock, selectors.EVENT_READ, index)
        while len(received) < len(sockets) and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.2):
                try:
                    data = key.fileobj.recv(4096)
                except (ConnectionResetError, BlockingIOError):
                    data = b""
                received[key.data] = received.get(key.data, b"") + data
                if not data or b'"code": "timeout"' in received[key.data]:
                    selector.unregister(key.fileobj)
    return received


def _timed(call) -> tuple[float, httpx.Response]:
    started = time.monotonic()
    response = call()
    return time.monotonic() - started, response


def test_soft_open_files_limit_is_raised_to_the_hard_limit(server):
    soft, hard = _open_files_limits(server.process.pid)
    assert soft == hard == resource.getrlimit(resource.RLIMIT_NOFILE)[1], (soft, hard)
    assert soft > USUAL_SOFT_LIMIT
    assert f"Open-files limit raised from {USUAL_SOFT_LIMIT} to {hard}" in server.log_text()


def test_idle_and_slow_header_clients_do_not_starve_the_server(server, http):
    idle = _connect(server.port, NUM_IDLE)
    slow = _connect(server.port, NUM_SLOW)
    stop = threading.Event()
    dribbler = threading.Thread(target=_dribble, args=(slow, stop), daemon=True)
    opened_at = time.monotonic()
    dribbler.start()
    try:
        health_s, health = _timed(lambda: http.get("/health"))
        completion_s, completion = _timed(lambda: http.post(
            "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}))
        assert health.status_code == 200 and completion.status_code == 200, completion.text
        assert health_s < ANSWER_WITHIN_S and completion_s < ANSWER_WITHIN_S, \
            (health_s, completion_s)
        assert time.monotonic() - opened_at < HEADER_TIMEOUT_S, "measured too late"

        answers = _answers_by(slow, opened_at + HEADER_TIMEOUT_S + 5)
        assert len(answers) == NUM_SLOW, f"{NUM_SLOW - len(answers)} slow clients still open"
        assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers.values())
        assert time.monotonic() - opened_at > HEADER_TIMEOUT_S
        closed = _answers_by(idle, opened_at + KEEP_ALIVE_S + 5)
        assert len(closed) == NUM_IDLE, f"{NUM_IDLE - len(closed)} idle sockets still open"
        assert all(a == b"" for a in closed.values())
        assert time.monotonic() - opened_at > KEEP_ALIVE_S
    finally:
        stop.set()
        dribbler.join(5)
        for sock in idle + slow:
            sock.close()
    assert http.get("/health").status_code == 200


def _is_open(sock: socket.socket) -> bool:
    try:
        sock.recv(1000)  # an answer, or b"" for closed
        return False
    except BlockingIOError:
        return True


def test_requests_beyond_the_concurrency_limit_get_503(server, http):
    # Requests in progress for as long as the test likes: their bodies are not all sent.
    held = _connect(server.port, LIMIT)
    for sock in held:
        sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    try:
        time.sleep(1.0)  # the server reads their headers and admits them
        refused = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert all(_is_open(sock) for sock in held), "a held request was answered"
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["x-request-id"]
        error = refused.json()["error"]
        assert error["code"] == "server_overloaded" and str(LIMIT) in error["message"]
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    status = None
    while time.monotonic() < deadline and status != 200:
        status = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code
        time.sleep(0.1)
    assert status == 200


def test_accept_errors_are_logged_once_per_interval(tiny_model, tmp_path):
    base = tiny_server(tiny_model, log_path=tmp_path / "server.log")
    with FdLimitedServer(base, USUAL_SOFT_LIMIT, USUAL_SOFT_LIMIT) as server:
        sockets = _connect(server.port, NUM_IDLE)  # queued by the kernel past the limit
        try:
            time.sleep(3)
        finally:
            for sock in sockets:
                sock.close()
        deadline = time.monotonic() + 15
        status = None
        while time.monotonic() < deadline and status != 200:
            try:
                status = httpx.get(server.url("/health"), timeout=2).status_code
            except httpx.HTTPError:
                time.sleep(0.2)
        assert status == 200, server.log_tail()
        log = server.log_text()
    assert 1 <= log.count("Cannot accept new connections") <= 2, log[-3000:]
    assert "socket.accept() out of system resource" not in log
    assert len(log) < 100_000
