"""Connection limits of the API server's HTTP server (uvicorn over h11; API-server process):
a header timeout and an idle timeout from the first byte (`http_protocol`), TCP_NODELAY on
every connection, the open-files limit raised at start-up (`raise_fd_limit`), and accept
errors logged once per interval (`AcceptErrorLog`).
"""

from __future__ import annotations

import asyncio
import resource
import socket
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.logger import init_logger

logger = init_logger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 10.0
ACCEPT_ERROR_INTERVAL_S = 10.0
_ACCEPT_ERROR = "socket.accept() out of system resource"  # asyncio's message
_TIMEOUT_BODY = (b'{"error": {"message": "The request headers did not arrive in time.", '
                 b'"type": "invalid_request_error", "param": null, "code": "timeout"}}')
_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's H11Protocol with two timers it lacks. A connection that has sent nothing yet is
    idle, like a kept-alive one, and is closed after the keep-alive timeout (uvicorn keeps it
    open forever). A request whose headers have started but are not complete after
    `header_timeout_s` (slowloris) gets a 408 and the connection is closed. Once the headers
    are in, the request's own time is unbounded (a long stream is normal). Every connection
    sends without Nagle's delay (`_send_without_delay`).
    """

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        _send_without_delay(transport)
        # uvicorn's own keep-alive timer slot: its data_received cancels it at the first byte.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        awaiting_headers = (self.conn.their_state is h11.IDLE
                            and not self.transport.is_closing())
        if awaiting_headers and self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s,
                                                      self._on_header_timeout)
        elif not awaiting_headers:
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.write(_TIMEOUT_RESPONSE)
            self.transport.close()


def _send_without_delay(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY on a connection's socket. asyncio sets it only where the socket's
    protocol number is IPPROTO_TCP, and the listening socket the server binds itself
    (startup.bind_socket, protocol 0) hands out connections that kept Nagle's algorithm: a
    response written in two parts (headers, then body; one SSE event after another) held
    its second part until the client acknowledged the first, which a kept-alive client
    delays (docs/cpu-performance.md has the measurement)."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:  # the connection is already gone
        pass


def http_protocol(header_timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class for uvicorn's `http=` with this header timeout."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,),
                {"header_timeout_s": header_timeout_s})


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft limit on open files to its hard limit, at start-up (the
    usual soft limit, 1,024, is a few hundred idle clients away); returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        logger.warning("Could not raise the open-files limit from %d to %d: %s", soft, hard,
                       exc)
        return soft, soft
    logger.info("Open-files limit raised from %d to %d.", soft, hard)
    return soft, hard


class AcceptErrorLog:
    """An asyncio exception handler: accept errors (out of file descriptors or memory) are
    logged once per `interval_s` with how many happened since the last line (asyncio
    retries every pending connection on each tick, thousands of lines a second); every
    other exception goes to the loop's default handler."""

    def __init__(self, interval_s: float = ACCEPT_ERROR_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.num_suppressed = 0
        self._logged_at: float | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.set_exception_handler(self)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != _ACCEPT_ERROR:
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if self._logged_at is not None and now - self._logged_at < self.interval_s:
            self.num_suppressed += 1
            return
        since = (f" ({self.num_suppressed} more since the last report)"
                 if self._logged_at is not None else "")
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        logger.error("Cannot accept new connections: %s (open-files limit %d)%s; logged at "
                     "most once every %.0f s.", context.get("exception"), soft, since,
                     self.interval_s)
        self._logged_at, self.num_suppressed = now, 0
