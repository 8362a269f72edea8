"""Llama 3.x JSON tool calls (API-server process): the answer is a call object `{"name": ...,
"parameters": {...}}` (or "arguments"), optionally after `<|python_tag|>`, several separated by
`;` (vLLM's `llama3_json`). An answer that does not start with a call is plain content."""

from __future__ import annotations

import re

from gateway.frontend.openai.tool_parsers.base import (
    ParsedToolCalls,
    ToolParser,
    scan_call_object,
    skip_space,
)

_TAG = "<|python_tag|>"
_SEPARATOR = re.compile(r"\s*;\s*")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, *, is_final: bool) -> ParsedToolCalls:
        start = skip_space(text, 0)
        if text.startswith(_TAG, start):
            start = skip_space(text, start + len(_TAG))
        elif not is_final and _TAG.startswith(text[start:]):
            return ParsedToolCalls()  # nothing yet, or what may become the tag
        if start == len(text) or text[start] != "{":
            return ParsedToolCalls(content=text)
        result = ParsedToolCalls()
        position = start
        while True:
            call, end = scan_call_object(text, position)
            if call is None:  # a JSON object that is not a call: the answer is text
                return ParsedToolCalls(content=text if is_final else "")
            result.tool_calls.append(call)
            separator = _SEPARATOR.match(text, end)
            if not call.is_complete or separator is None or end == len(text) \
                    or not text.startswith("{", separator.end()):
                break
            position = separator.end()
        if is_final:
            _check_final(result, text[end:])
        return result


def _check_final(result: ParsedToolCalls, rest: str) -> None:
    if not result.tool_calls[-1].is_complete:
        raise ValueError("the last tool-call object is not complete")
    if rest.strip(" \n;"):
        raise ValueError(f"text after the tool calls: {rest.strip()[:40]!r}")

