"""Mistral tool calls (API-server process) after the `[TOOL_CALLS]` token, in either of
Mistral's forms: a JSON array of `{"name": ..., "arguments": {...}}` objects (tokenizer v3/v7
templates; an "id" key is allowed), or `name[ARGS]{...}` per call, each after its own
`[TOOL_CALLS]` (v11+). The text before the first `[TOOL_CALLS]` is the content (vLLM's
`mistral`). Call ids are nine letters and digits, as Mistral's templates require."""

from __future__ import annotations

import json
import random
import re
import string
from typing import Any

from gateway.frontend.openai.tool_parsers.base import (
    ParsedToolCalls,
    ToolCallPart,
    ToolParser,
    held_back,
    scan_call_object,
    skip_space,
)

_TOKEN, _ARGS = "[TOOL_CALLS]", "[ARGS]"
_SEPARATOR = re.compile(r"\s*,\s*")
_DECODER = json.JSONDecoder()
_ID_ALPHABET = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"

    def adjust_request(self, request: Any) -> Any:
        # [TOOL_CALLS] is a special token: keep it in the text unless the client chose.
        if "skip_special_tokens" in request.model_fields_set:
            return request
        return request.model_copy(update={"skip_special_tokens": False})

    def make_tool_call_id(self) -> str:
        return "".join(random.choices(_ID_ALPHABET, k=9))

    def parse(self, text: str, *, is_final: bool) -> ParsedToolCalls:
        first = text.find(_TOKEN)
        if first < 0:
            keep = 0 if is_final else held_back(text, _TOKEN)
            return ParsedToolCalls(content=text[:len(text) - keep])
        body = skip_space(text, first + len(_TOKEN))
        if body == len(text) and not is_final:
            calls: list[ToolCallPart] = []
        elif text.startswith("[", body):
            calls = _array_calls(text, body + 1, is_final)
        else:
            calls = _args_calls(text[first:], is_final)
        if is_final and (not calls or not calls[-1].is_complete):
            raise ValueError("the [TOOL_CALLS] section holds no complete call")
        return ParsedToolCalls(content=text[:first], tool_calls=calls)


def _array_calls(text: str, position: int, is_final: bool) -> list[ToolCallPart]:
    calls: list[ToolCallPart] = []
    position = skip_space(text, position)
    while position < len(text) and text[position] == "{":
        call, end = scan_call_object(text, position)
        if call is None:
            raise ValueError("an object in the [TOOL_CALLS] array is not a call")
        calls.append(call)
        if not call.is_complete:
            return calls
        separator = _SEPARATOR.match(text, end)
        position = separator.end() if separator and separator.group() else end
    if is_final and not text[position:].strip().startswith("]"):
        raise ValueError("the [TOOL_CALLS] array is not closed")
    return calls


def _args_calls(section: str, is_final: bool) -> list[ToolCallPart]:
    """`[TOOL_CALLS]name[ARGS]{...}` repeated; `section` starts at the first token."""
    calls = []
    for part in section.split(_TOKEN)[1:]:
        name, has_args, arguments = part.partition(_ARGS)
        if not has_args:
            if is_final:
                raise ValueError(f"no {_ARGS} after the tool name {name.strip()!r}")
            calls.append(ToolCallPart(None))
            break
        arguments = arguments.lstrip()
        try:
            _, end = _DECODER.raw_decode(arguments)
        except json.JSONDecodeError:
            calls.append(ToolCallPart(name.strip(), arguments))
            break
        calls.append(ToolCallPart(name.strip(), arguments[:end], is_complete=True))
    return calls
