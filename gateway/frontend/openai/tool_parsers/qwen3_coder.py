"""Qwen3-Coder tool calls (vLLM's `qwen3_coder`; API-server process): XML-like blocks, one
tag a line, `<tool_call>`, `<function=get_weather>`, `<parameter=city>`, `Paris`,
`</parameter>`, `</function>`, `</tool_call>`.

Any number of them; the text before the first block is the content. Parameter values are
text, typed by the function's `parameters` schema in the request's tools (string, integer,
number, boolean; anything else read as JSON or a Python literal, else kept as text). A
call's arguments stream one parameter at a time.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from typing import Any

from gateway.frontend.openai.tool_parsers.base import (
    ParsedToolCalls,
    ToolCallPart,
    ToolParser,
    held_back,
    skip_space,
)

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
_PARAMETER_END, _FUNCTION_END = "</parameter>", "</function>"
_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def parse(self, text: str, *, is_final: bool) -> ParsedToolCalls:
        first = text.find(_OPEN)
        if first < 0:
            keep = 0 if is_final else held_back(text, _OPEN)
            return ParsedToolCalls(content=text[:len(text) - keep])
        result = ParsedToolCalls(content=text[:first])
        position = first
        while position >= 0:
            end = text.find(_CLOSE, position)
            block = text[position + len(_OPEN):end if end >= 0 else len(text)]
            call = self._call(block)
            if call is None:
                break
            if end >= 0 and not call.is_complete:
                raise ValueError("a <tool_call> block does not hold one whole <function>")
            result.tool_calls.append(call)
            position = text.find(_OPEN, end + len(_CLOSE)) if end >= 0 else -1
        if is_final and not (result.tool_calls and result.tool_calls[-1].is_complete):
            raise ValueError("the last <tool_call> block is not complete")
        return result

    def _call(self, block: str) -> ToolCallPart | None:
        function = _FUNCTION.match(block)
        if function is None:
            if block.strip() and not "<function=".startswith(block.strip()[:10]):
                raise ValueError(f"a <tool_call> block without <function=...>: {block[:40]!r}")
            return None
        name = function.group(1).strip()
        schema = self._properties(name)
        pieces, position = [], function.end()
        while (parameter := _PARAMETER.match(block, position)) is not None:
            value_end = block.find(_PARAMETER_END, parameter.end())
            if value_end < 0:
                break
            key = parameter.group(1).strip()
            value = _typed(_strip_newlines(block[parameter.end():value_end]), schema.get(key))
            pieces.append(f"{json.dumps(key, ensure_ascii=False)}: "
                          f"{json.dumps(value, ensure_ascii=False)}")
            position = value_end + len(_PARAMETER_END)
        is_complete = block.startswith(_FUNCTION_END, skip_space(block, position))
        arguments = "{" + ", ".join(pieces) if pieces else ""
        if is_complete:
            arguments = (arguments or "{") + "}"
        return ToolCallPart(name, arguments, is_complete=is_complete)

    def _properties(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            function = tool.get("function") or {}
            if function.get("name") == name:
                properties = (function.get("parameters") or {}).get("properties")
                return properties if isinstance(properties, dict) else {}
        return {}


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as the value its schema asks for (text when it does not fit)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if value.lower() == "null" and kind not in _STRING_TYPES:
        return None
    if kind is None or kind in _STRING_TYPES:
        return value
    readers: dict[str, Callable[[str], Any]] = {
        "integer": int, "int": int, "number": _number, "float": float,
        "boolean": _boolean, "bool": _boolean}
    readers_in_order: list[Callable[[str], Any]] = \
        [readers[kind]] if kind in readers else [json.loads, ast.literal_eval]
    for reader in readers_in_order:
        try:
            return reader(value.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return value


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def _boolean(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise ValueError(text)
    return text.lower() == "true"


def _strip_newlines(value: str) -> str:
    """The value between the tags, less the one newline the format puts on each side."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value

