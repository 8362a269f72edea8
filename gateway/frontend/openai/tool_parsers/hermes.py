"""Hermes-style tool calls (API-server process): `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`, one JSON object per block, any number of blocks (Hermes, Qwen2.5/3, SmolLM3
templates)."""

from __future__ import annotations

from gateway.frontend.openai.tool_parsers.base import (
    ParsedToolCalls,
    ToolParser,
    held_back,
    scan_call_object,
    skip_space,
)

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, *, is_final: bool) -> ParsedToolCalls:
        first = text.find(_OPEN)
        if first < 0:
            keep = 0 if is_final else held_back(text, _OPEN)
            return ParsedToolCalls(content=text[:len(text) - keep])
        result = ParsedToolCalls(content=text[:first])
        position = first
        while position >= 0:
            start = skip_space(text, position + len(_OPEN))
            end = text.find(_CLOSE, start)
            block = text[:end] if end >= 0 else text
            call, _ = scan_call_object(block, start)
            if end >= 0 and (call is None or not call.is_complete):
                raise ValueError("a <tool_call> block does not hold one tool-call object")
            if call is not None:
                result.tool_calls.append(call)
            if end < 0:
                break
            position = text.find(_OPEN, end + len(_CLOSE))
        if is_final and result.tool_calls and not result.tool_calls[-1].is_complete:
            raise ValueError("the last <tool_call> block is not closed")
        return result

