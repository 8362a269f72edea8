"""Raw ASGI middleware of the front end: request ids (with the last-resort 500), the
concurrency limit and the body size limit.

Pure ASGI classes rather than `BaseHTTPMiddleware`: each costs one call and, where needed,
one wrapped `send`, so a plugin route stays as fast as the same handler in a bare app.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.frontend.http.errors import error_body
from gateway.logger import current_request_id, init_logger

logger = init_logger(__name__)

REQUEST_ID_HEADER = b"x-request-id"
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
_MAX_REQUEST_ID_LENGTH = 128

#: Routes that load balancers and Prometheus poll: the concurrency limit never refuses them.
PROBE_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/load"})
CONCURRENCY_RETRY_AFTER_S = 1

#: Called with (scope, exception) for an exception no handler answered (a metrics hook).
UnhandledErrorHook = Callable[[Scope, BaseException], None]


def request_id_of(scope: Scope) -> str | None:
    """The request id the middleware gave this request (also `request.state.request_id`)."""
    state = scope.get("state")
    return state.get("request_id") if isinstance(state, dict) else None


class RequestIdMiddleware:
    """Give every HTTP request an id and every response an `X-Request-Id` header.

    The id is the client's `X-Request-Id` when it sent a usable one (printable ASCII, at
    most 128 characters), else 32 random hex digits; handlers read it as
    `request.state.request_id`. An exception that no handler answered (a plugin route that
    raises) is logged with its traceback and answered 500 with the request id; the server
    keeps serving and the client never sees the traceback.
    """

    def __init__(self, app: ASGIApp, on_unhandled_error: UnhandledErrorHook | None = None
                 ) -> None:
        self.app = app
        self.on_unhandled_error = on_unhandled_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _client_request_id(scope) or os.urandom(16).hex()  # cheaper than uuid4
        scope.setdefault("state", {})["request_id"] = request_id
        current_request_id.set(request_id)  # log lines about this request carry its id
        header = (REQUEST_ID_HEADER, request_id.encode("latin-1"))
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if self.on_unhandled_error is not None:
                self.on_unhandled_error(scope, exc)
            if started:  # too late for an error response: let the server drop the connection
                raise
            logger.exception("Unhandled error in %s %s (request id %s)", scope.get("method"),
                             scope.get("path"), request_id)
            await send_error(send_with_id, 500, "The server had an error while processing "
                              f"your request. Request id: {request_id}.",
                              code="internal_error")


def _client_request_id(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == REQUEST_ID_HEADER:
            if 0 < len(value) <= _MAX_REQUEST_ID_LENGTH and all(33 <= b < 127 for b in value):
                return str(value.decode("ascii"))
            return None
    return None


class ConcurrencyLimitMiddleware:
    """Answer 503 with `Retry-After` to an HTTP request that arrives while `limit` others
    are in progress (a stream counts until its last byte). Requests, not connections, are
    counted, so idle keep-alive connections take nothing from the limit; the probe paths
    are never refused."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.num_active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _route_path(scope) in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        if self.num_active >= self.limit:
            await send_error(send, 503, f"The server is at its limit of {self.limit} "
                             "concurrent requests; retry later.", code="server_overloaded",
                             headers=[(b"retry-after", str(CONCURRENCY_RETRY_AFTER_S).encode())])
            return
        self.num_active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_active -= 1


def route_path(scope: Scope) -> str:
    """The request's path without the app's root path (what PROBE_PATHS holds)."""
    return _route_path(scope)


def _route_path(scope: Scope) -> str:
    path: str = scope["path"]
    root = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class BodyTooLargeError(HTTPException):
    """Raised from `receive` when a body without Content-Length grows past the limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The request body is larger than the limit of {limit} bytes.")


class BodySizeLimitMiddleware:
    """Answer 413 to a request body over `max_body_bytes`.

    With a Content-Length header the check is done before the app runs (the HTTP server
    holds the body to that length). Without one (chunked upload) the received bytes are
    counted, and `receive` raises `BodyTooLargeError` once they pass the limit.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None:
            if length > self.max_body_bytes:
                await send_error(send, 413, str(BodyTooLargeError(self.max_body_bytes).detail),
                                  code="request_too_large")
                return
            await self.app(scope, receive, send)
            return
        await self._call_counting(scope, receive, send)

    async def _call_counting(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit, received, started = self.max_body_bytes, 0, False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLargeError(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLargeError as exc:
            if started:
                raise
            await send_error(send, 413, str(exc.detail), code="request_too_large")


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def send_error(send: Send, status: int, message: str, *, code: str | None = None,
                      headers: list[tuple[bytes, bytes]] | None = None,
                      param: str | None = None) -> None:
    """Send an OpenAI-shaped error response straight from middleware."""
    body = error_body(status, message, code=code, param=param)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(headers or []),
    ]})
    await send({"type": "http.response.body", "body": body})
