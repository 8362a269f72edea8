"""Pythonic tool calls (API-server process): a Python list of calls with keyword arguments,
`[get_weather(city="Paris"), get_time()]` (Llama 3.2 / 4 and others; vLLM's `pythonic`),
at the end of the answer, optionally between `<|python_start|>` and `<|python_end|>`; the
text before it is the content. Values are Python literals; each call's arguments become a
JSON object. An answer with no `[name(` is plain content."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from gateway.frontend.openai.tool_parsers.base import (
    ParsedToolCalls,
    ToolCallPart,
    ToolParser,
    held_back,
    skip_space,
)

_START, _END = "<|python_start|>", "<|python_end|>"
_CALL_HEAD = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_LIST_HEAD = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_PARTIAL_LIST_HEAD = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?\Z")


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, *, is_final: bool) -> ParsedToolCalls:
        head = _LIST_HEAD.search(text)
        if head is None:
            return ParsedToolCalls(content=text if is_final else text[:_held(text)])
        content = text[:head.start()]
        if content.rstrip().endswith(_START):
            content = content.rstrip()[:-len(_START)]
        calls: list[ToolCallPart] = []
        position = head.start() + 1
        while (call_head := _CALL_HEAD.match(text, position)) is not None:
            close = _closing_paren(text, call_head.end())
            if close is None:
                calls.append(ToolCallPart(call_head.group(1)))
                break
            calls.append(_call(text[call_head.start(1):close + 1]))
            position = skip_space(text, close + 1)
            if not text.startswith(",", position):
                break
            position = position + 1
        if is_final:
            _check_final(calls, text[position:])
        return ParsedToolCalls(content=content, tool_calls=calls)


def _held(text: str) -> int:
    """Where the text that may still become the list of calls (or its marker) starts."""
    partial = _PARTIAL_LIST_HEAD.search(text)
    end = partial.start() if partial else len(text) - held_back(text, _START)
    if text[:end].rstrip().endswith(_START):
        end = text[:end].rstrip().rindex(_START)
    return end


def _call(source: str) -> ToolCallPart:
    """One whole call `name(key=literal, ...)` as a complete ToolCallPart."""
    node = ast.parse(source, mode="eval").body
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError(f"not a call with keyword arguments: {source[:60]!r}")
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise ValueError("**kwargs in a tool call")
        arguments[keyword.arg] = ast.literal_eval(keyword.value)
    return ToolCallPart(ast.unparse(node.func), json.dumps(arguments, ensure_ascii=False),
                        is_complete=True)


def _closing_paren(text: str, position: int) -> int | None:
    """Where the call whose arguments start at `position` closes (None: not yet)."""
    depth, quote = 1, ""
    index = position
    while index < len(text):
        char = text[index]
        if quote:
            if char == "\\":
                index += 1
            elif text.startswith(quote, index):
                index += len(quote) - 1
                quote = ""
        elif char in "\"'":
            quote = char * 3 if text.startswith(char * 3, index) else char
            index += len(quote) - 1
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return index
        index += 1
    return None


def _check_final(calls: list[ToolCallPart], rest: str) -> None:
    if not calls[-1].is_complete:
        raise ValueError(f"the call to {calls[-1].name!r} is not closed")
    rest = rest.strip()
    if not rest.startswith("]") or rest[1:].replace(_END, "").strip():
        raise ValueError(f"the list of calls is not closed: {rest[:40]!r}")

