"""The tool-parser contract (front end): model text in, tool calls out.

A parser is asked about the whole text generated so far, as often as new text arrives
(`is_final` False) and once more at the end (`is_final` True). What it returns must only
grow from one call to the next: the content is a prefix of the final content, each call's
arguments a prefix of its final arguments. The route turns the growth into OpenAI's
streaming deltas, so a parser never deals with deltas, and a streamed answer reassembles to
exactly the non-streamed one. A parser that only parses whole answers returns
`ParsedToolCalls()` until `is_final`.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCallPart:
    """One tool call as far as it is known. `arguments` is JSON text (possibly cut short
    while the call is incomplete)."""

    name: str | None
    arguments: str = ""
    is_complete: bool = False


@dataclass
class ParsedToolCalls:
    content: str = ""  # text for `message.content` (outside the calls)
    tool_calls: list[ToolCallPart] = field(default_factory=list)


class ToolParser(ABC):
    """Subclass, set `name`, implement `parse`; register with `register_tool_parser` or an
    entry point in the `vllm.tool_parsers` group (docs/tool-calling.md). Made once per
    request, in the API-server process, with the server's tokenizer."""

    name: str = ""
    #: The request's tool definitions (OpenAI's `{"type": "function", "function": {...}}`),
    #: set by the server after the parser is made, before the first `parse`; a parser that
    #: types arguments by each function's `parameters` schema reads them here.
    tools: tuple[dict[str, Any], ...] = ()

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def parse(self, text: str, *, is_final: bool) -> ParsedToolCalls:
        """What the text so far holds (`is_final`: the model has finished)."""

    def adjust_request(self, request: Any) -> Any:
        """Called once per chat request that lets the model call tools, before its sampling
        parameters are made; returns the request to use (vLLM's hook: a parser whose
        markers are special tokens keeps them in the text here)."""
        return request

    def make_tool_call_id(self) -> str:
        """The id of one call in the answer (a format may require its own shape)."""
        return f"chatcmpl-tool-{uuid.uuid4().hex}"


# ------------------------------------------------------------------ helpers for parsers
_DECODER = json.JSONDecoder()
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"'
                   r'\s*:\s*')
_CLOSE = re.compile(r"\s*\}")


def scan_call_object(text: str, start: int) -> tuple[ToolCallPart | None, int]:
    """The call in the JSON object at `text[start]` ('{"name": ..., "arguments": {...}}',
    or "parameters" for "arguments"), and where it ends (len(text) while incomplete).

    The arguments are the model's own text of the value, so partial and final agree. An
    object with its keys in another order is known only once complete. (None, end) for a
    complete object that is not a call."""
    head = _HEAD.match(text, start)
    if head is None:
        try:
            value, end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            return ToolCallPart(None), len(text)
        return _call_from_value(value), end
    name = json.loads(f'"{head.group(1)}"')
    try:
        _, args_end = _DECODER.raw_decode(text, head.end())
    except json.JSONDecodeError:
        return ToolCallPart(name, text[head.end():]), len(text)
    close = _CLOSE.match(text, args_end)
    arguments = text[head.end():args_end]
    if close is None:  # more keys after the arguments (an "id"): complete with the object
        try:
            _, end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            return ToolCallPart(name, arguments), len(text)
        return ToolCallPart(name, arguments, is_complete=True), end
    return ToolCallPart(name, arguments, is_complete=True), close.end()


def _call_from_value(value: Any) -> ToolCallPart | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        return ToolCallPart(value["name"], arguments, is_complete=True)
    return ToolCallPart(value["name"], json.dumps(arguments, ensure_ascii=False),
                        is_complete=True)


_SPACE = re.compile(r"\s*")


def skip_space(text: str, position: int) -> int:
    """The first position at or after `position` that is not whitespace."""
    return _SPACE.match(text, position).end()  # type: ignore[union-attr]


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (so they
    are not sent as content yet)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
