"""One rule for text that is not Unicode (API-server process, raw ASGI middleware): a JSON
request body that escapes a lone UTF-16 surrogate (`"\\ud800"`: a high surrogate without
its low half, or a low one alone) is refused with 400, `param` naming the field, before
any route sees it.

Python's JSON parser accepts such escapes and makes strings that cannot be encoded as
UTF-8, so without this rule they fail deeper (the tokenizer, the engine's messages) as a
500. A surrogate *pair* (an emoji escaped by an ASCII-only JSON encoder) is valid and
passes. The body is scanned with C-speed regular expressions; only a body they flag is
parsed again to name the field.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.frontend.http.middleware import send_error

_HIGH = rb"\\u[dD][89abAB][0-9a-fA-F]{2}"
_LOW = rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}"
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_PAIR = re.compile(_HIGH + _LOW)


def has_lone_surrogate_escape(body: bytes) -> bool:
    """Whether `body` escapes a surrogate that is not half of a pair.

    Read as a JSON parser reads it, left to right: first the escaped backslashes are
    blanked (in "\\\\ud800" the text "ud800" follows one), so that every backslash left
    starts an escape; then the pairs are taken out; any surrogate escape left is alone.
    Only literal searches and one `sub` with no look-behind: C speed, linear."""
    if b"\\u" not in body:
        return False
    body = body.replace(b"\\\\", b"__")
    if _SURROGATE_ESCAPE.search(body) is None:
        return False
    return _SURROGATE_ESCAPE.search(_PAIR.sub(b"", body)) is not None


def surrogate_field(value: Any, path: str = "") -> str | None:
    """The path (`messages[0].content`) of the first string (or key) in a parsed JSON value
    holding a lone surrogate; None if there is none. Iterative: any depth."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if _is_not_unicode(item):
                return where or "body"
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                name = f"{where}.{key}" if where else str(key)
                if _is_not_unicode(str(key)):
                    return where or "body"
                stack.append((child, name))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{i}]") for i, child in reversed(list(enumerate(item))))
    return None


def _is_not_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class LoneSurrogateMiddleware:
    """Reads a JSON body whole, refuses it when it escapes a lone surrogate, and replays it
    to the app otherwise (then passes later messages, such as the disconnect, through)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if has_lone_surrogate_escape(body):
            field = _field_of(body)
            if field is not None:
                await send_error(send, 400, f"The field {field!r} holds a lone UTF-16 "
                                 "surrogate (an unpaired \\ud800-\\udfff escape), which is not "
                                 "text.", code="invalid_unicode", param=field)
                return
        await self.app(scope, _replay([{"type": "http.request", "body": body,
                                        "more_body": False}], receive), send)


def _field_of(body: bytes) -> str | None:
    try:
        return surrogate_field(json.loads(body))
    except (ValueError, RecursionError):
        return None  # not JSON after all: the route says what is wrong with it


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replaying_receive() -> Message:
        return pending.pop(0) if pending else await receive()

    return replaying_receive


def _is_json(scope: Scope) -> bool:
    """A JSON content type, or none (FastAPI parses a body without one as JSON)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or media.endswith(b"+json")
    return True
