"""The assistant's answer as a chat message (front end): reasoning split off, tool calls
read from the text, whole (`final_message`) or as streaming deltas (`MessageStream`).

Both run the same parsers on the text generated so far, so a streamed answer reassembles
to exactly the non-streamed one. A parser that raises never fails the request: the text is
the content, with a WARNING.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.frontend.openai.chat_parsers import ChatParsers
from gateway.frontend.openai.chat_tools import ToolPlan
from gateway.frontend.openai.tool_parsers import ParsedToolCalls, ToolCallPart, ToolParser
from gateway.frontend.openai.tool_parsers.json_parser import JsonToolParser
from gateway.logger import init_logger

logger = init_logger(__name__)


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class Answer:
    reasoning: str | None = None
    content: str = ""
    tool_calls: list[ToolCallPart] = field(default_factory=list)


class AnswerParser:
    """One request's parsers: reasoning first, then tool calls in what is left."""

    def __init__(self, plan: ToolPlan, parsers: ChatParsers, tokenizer: Any) -> None:
        self.plan = plan
        self.reasoning = parsers.reasoning_parser(tokenizer) if parsers.reasoning_parser \
            else None
        self.tools: ToolParser | None = None
        if plan.mode == "auto" and parsers.tool_parser is not None:
            self.tools = parsers.tool_parser(tokenizer)
        elif plan.mode == "required":
            self.tools = JsonToolParser(tokenizer)
        if self.tools is not None:
            self.tools.tools = plan.tools
        self.has_failed = False

    def make_tool_call_id(self) -> str:
        return self.tools.make_tool_call_id() if self.tools is not None else tool_call_id()

    @property
    def has_reasoning(self) -> bool:
        return self.reasoning is not None

    def parse(self, text: str, *, is_final: bool) -> Answer:
        reasoning, content = (self.reasoning.parse(text, is_final=is_final)
                              if self.reasoning is not None else (None, text))
        if self.plan.mode == "named":
            call = ToolCallPart(self.plan.function, content, is_complete=is_final)
            return Answer(reasoning, "", [call])
        if self.tools is None or self.has_failed:
            return Answer(reasoning, content)
        try:
            parsed: ParsedToolCalls = self.tools.parse(content, is_final=is_final)
        except Exception as exc:  # a parser's bug or odd model text: the text is content
            logger.warning("Tool parser %s failed (%s: %s); the answer is returned as "
                           "content.", type(self.tools).__name__, type(exc).__name__, exc)
            self.has_failed = True
            return Answer(reasoning, content)
        calls = parsed.tool_calls if self.plan.parallel else parsed.tool_calls[:1]
        return Answer(reasoning, parsed.content, calls)


def adjust_request(body: Any, plan: ToolPlan, parsers: ChatParsers, tokenizer: Any) -> Any:
    """The request as the tool parser wants it (its `adjust_request`), when the model may
    call tools of its own choice."""
    if plan.mode != "auto" or parsers.tool_parser is None:
        return body
    return parsers.tool_parser(tokenizer).adjust_request(body)


def final_message(parser: AnswerParser, text: str, finish_reason: str | None
                  ) -> tuple[dict[str, Any], str | None]:
    """The `message` of a non-streamed answer, and its finish reason ("tool_calls" when
    the model called tools of its own choice or as required)."""
    answer = parser.parse(text, is_final=True)
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if parser.has_reasoning:
        message["reasoning_content"] = answer.reasoning
    if answer.tool_calls:
        message["content"] = answer.content if answer.content.strip() else None
        message["tool_calls"] = [
            {"id": parser.make_tool_call_id(), "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for call in answer.tool_calls]
        finish_reason = _tool_finish(parser.plan, finish_reason)
    return message, finish_reason


def _tool_finish(plan: ToolPlan, finish_reason: str | None) -> str | None:
    # OpenAI answers a named tool_choice with "stop", its own choice with "tool_calls".
    return "tool_calls" if finish_reason == "stop" and plan.mode != "named" else finish_reason


@dataclass
class _SentCall:
    id: str
    arguments: int = 0  # characters of the arguments sent


class MessageStream:
    """Turns the growing text of one answer into OpenAI delta objects."""

    def __init__(self, parser: AnswerParser) -> None:
        self.parser = parser
        self.text = ""
        self._sent_reasoning = 0
        self._sent_content = 0
        self._calls: list[_SentCall] = []

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._calls)

    def feed(self, delta_text: str, is_final: bool) -> list[dict[str, Any]]:
        """The deltas for this much more text (none when there is nothing new to send):
        reasoning and content first, then per tool call a delta with its index, id and
        name (arguments "") when it starts, and deltas with pieces of its arguments."""
        self.text += delta_text
        answer = self.parser.parse(self.text, is_final=is_final)
        delta: dict[str, Any] = {}
        if answer.reasoning is not None and len(answer.reasoning) > self._sent_reasoning:
            delta["reasoning_content"] = answer.reasoning[self._sent_reasoning:]
            self._sent_reasoning = len(answer.reasoning)
        if len(answer.content) > self._sent_content:
            delta["content"] = answer.content[self._sent_content:]
            self._sent_content = len(answer.content)
        deltas = [delta] if delta else []
        return deltas + [{"tool_calls": [call]} for call in self._call_deltas(answer.tool_calls)]

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return _tool_finish(self.parser.plan, finish_reason) if self._calls else finish_reason

    def _call_deltas(self, calls: list[ToolCallPart]) -> list[dict[str, Any]]:
        deltas = []
        for index, call in enumerate(calls):
            if call.name is None:
                break  # its name is not known yet: nothing of it (or later ones) to send
            if index == len(self._calls):
                self._calls.append(_SentCall(self.parser.make_tool_call_id()))
                deltas.append({"index": index, "id": self._calls[index].id,
                               "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            sent = self._calls[index]
            if len(call.arguments) > sent.arguments:
                deltas.append({"index": index,
                               "function": {"arguments": call.arguments[sent.arguments:]}})
                sent.arguments = len(call.arguments)
        return deltas
