"""API-key auth for every route, plugin routes included (API-server process, raw ASGI).

With a key set (`--api-key` or VLLM_API_KEY), every request needs
`Authorization: Bearer KEY`, except the public paths: `/health`, `/ping`, `/version` and
`/metrics` (unless `--protect-metrics`). vLLM guards only some path prefixes, so a plugin
route outside them is open; here the rule is "everything but an explicit public set",
which includes plugin routes, unknown paths (401, not 404) and the OpenAPI docs.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.frontend.http.middleware import send_error

PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})


def public_paths(protect_metrics: bool) -> frozenset[str]:
    """The paths served without a key."""
    return PUBLIC_PATHS - {"/metrics"} if protect_metrics else PUBLIC_PATHS


class APIKeyMiddleware:
    """Answer 401 (OpenAI-shaped, `code: invalid_api_key`) to a request without the key.

    The key is compared in constant time and never echoed back or logged.
    """

    def __init__(self, app: ASGIApp, api_key: str, public: Iterable[str] = PUBLIC_PATHS
                 ) -> None:
        if not api_key:
            raise ValueError("APIKeyMiddleware needs a non-empty API key")
        self.app = app
        self._key = api_key.encode()
        self._public = frozenset(public)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or _route_path(scope) in self._public:
            await self.app(scope, receive, send)
            return
        if self._is_authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send_error(send, 401, "Missing or incorrect API key. Send it as "
                          "'Authorization: Bearer <key>'.", code="invalid_api_key",
                          headers=[(b"www-authenticate", b"Bearer")])

    def _is_authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(),
                                                                           self._key)
        return False


def _route_path(scope: Scope) -> str:
    """The path without the root path, as the router matches it."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root):] or "/"
    return path
