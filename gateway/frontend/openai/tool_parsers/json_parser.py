"""Plain JSON tool calls (API-server process): the whole answer is one call object `{"name": ...,
"arguments": {...}}` (or "parameters"), or a JSON array of them. Also the format a
`required` tool choice is constrained to."""

from __future__ import annotations

import re

from gateway.frontend.openai.tool_parsers.base import (
    ParsedToolCalls,
    ToolParser,
    scan_call_object,
    skip_space,
)

_SEPARATOR = re.compile(r"\s*,\s*")


class JsonToolParser(ToolParser):
    name = "json"

    def parse(self, text: str, *, is_final: bool) -> ParsedToolCalls:
        start = skip_space(text, 0)
        if start == len(text):
            return ParsedToolCalls()
        if text[start] == "{":
            call, end = scan_call_object(text, start)
            if call is None or (is_final and (not call.is_complete or text[end:].strip())):
                return _as_content(text, is_final)
            return ParsedToolCalls(tool_calls=[call])
        if text[start] == "[":
            return self._parse_list(text, start + 1, is_final)
        return _as_content(text, is_final)

    @staticmethod
    def _parse_list(text: str, position: int, is_final: bool) -> ParsedToolCalls:
        result = ParsedToolCalls()
        position = skip_space(text, position)
        while position < len(text) and text[position] == "{":
            call, end = scan_call_object(text, position)
            if call is None:
                return _as_content(text, is_final)
            result.tool_calls.append(call)
            if not call.is_complete:
                break
            separator = _SEPARATOR.match(text, end)
            position = separator.end() if separator and separator.group() else end
        if is_final and (not result.tool_calls or not text[position:].strip().startswith("]")):
            return _as_content(text, is_final)
        return result


def _as_content(text: str, is_final: bool) -> ParsedToolCalls:
    """Not a call: the answer is plain text (known only at the end, once it could no longer
    turn into a call)."""
    return ParsedToolCalls(content=text if is_final else "")
