"""Reasoning parsers (front end): a model's `<think>...</think>` text split from its answer,
chosen with `--reasoning-parser NAME` (vLLM's flag).

Like the tool parsers, a reasoning parser is asked about the whole text so far and returns
(reasoning, content), each only growing between calls; the route streams the growth as
`reasoning_content` and `content` deltas.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from gateway.frontend.openai.tool_parsers.base import held_back

_START, _END = "<think>", "</think>"


class ReasoningParser(ABC):
    """`parse(text, is_final)` -> (reasoning or None, content)."""

    name = ""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def parse(self, text: str, *, is_final: bool) -> tuple[str | None, str]:
        """What the text so far holds (`is_final`: the model has finished)."""


class DeepSeekR1ReasoningParser(ReasoningParser):
    """Everything up to `</think>` is reasoning (the template may have written `<think>`
    into the prompt, so the opening tag is optional); no `</think>` at all: all of it is
    reasoning, as for DeepSeek-R1, whose answers always think first."""

    name = "deepseek_r1"

    def parse(self, text: str, *, is_final: bool) -> tuple[str | None, str]:
        body = _strip_start(text, is_final)
        if body is None:
            return None, ""
        end = body.find(_END)
        if end >= 0:
            return body[:end], body[end + len(_END):]
        keep = 0 if is_final else held_back(body, _END)
        return body[:len(body) - keep], ""


class Qwen3ReasoningParser(ReasoningParser):
    """Reasoning only inside an explicit `<think>...</think>` at the start; an answer that
    does not open with `<think>` (thinking switched off) is all content. One cut short
    before `</think>` is all reasoning."""

    name = "qwen3"

    def parse(self, text: str, *, is_final: bool) -> tuple[str | None, str]:
        stripped = text.lstrip()
        if not stripped.startswith(_START):
            if not is_final and _START.startswith(stripped):
                return None, ""  # may still become <think>
            return None, text
        body = stripped[len(_START):]
        end = body.find(_END)
        if end >= 0:
            return body[:end], body[end + len(_END):]
        keep = 0 if is_final else held_back(body, _END)
        return body[:len(body) - keep], ""  # cut short while thinking: all reasoning


def _strip_start(text: str, is_final: bool) -> str | None:
    """`text` without a leading `<think>`; None while it could still be one."""
    stripped = text.lstrip()
    if stripped.startswith(_START):
        return stripped[len(_START):]
    if not is_final and stripped and _START.startswith(stripped):
        return None
    return text


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: "
                         f"{', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]
