"""Output items of a /v1/responses answer: the same items whether the text comes whole or
in pieces, each item announced by its events in the Responses API's order."""

from __future__ import annotations

import json

import pytest

from gateway.frontend.openai.chat_output import AnswerParser, MessageStream
from gateway.frontend.openai.chat_parsers import ChatParsers
from gateway.frontend.openai.chat_tools import ToolPlan
from gateway.frontend.openai.reasoning_parsers import get_reasoning_parser
from gateway.frontend.openai.responses_output import OutputItems
from gateway.frontend.openai.tool_parsers import get_tool_parser

ANSWER = ('<think>Weather first.</think>Let me look.\n<tool_call>\n{"name": "get_weather", '
          '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
          '"arguments": {"zone": "CET"}}\n</tool_call>')


def _items(reasoning: str | None = "qwen3") -> OutputItems:
    parsers = ChatParsers(tool_parser=get_tool_parser("hermes"),
                          reasoning_parser=get_reasoning_parser(reasoning) if reasoning
                          else None)
    return OutputItems(MessageStream(AnswerParser(ToolPlan(mode="auto"), parsers, None)))


def _feed(items: OutputItems, text: str, piece: int) -> list[dict]:
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)] or [""]
    events = []
    for i, chunk in enumerate(pieces):
        events += items.feed(chunk, i == len(pieces) - 1)
    return events + items.finish(is_truncated=False)


def _without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


@pytest.mark.parametrize("piece", [1, 3, 7, len(ANSWER)])
def test_pieces_of_any_size_give_the_items_of_the_whole_answer(piece):
    whole, streamed = _items(), _items()
    _feed(whole, ANSWER, len(ANSWER))
    events = _feed(streamed, ANSWER, piece)
    assert _without_ids(streamed.items) == _without_ids(whole.items)
    reasoning, message, *calls = streamed.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Weather first."}]
    assert message["content"][0]["text"] == "Let me look.\n"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    # Every item is added, then done, before the next one is added.
    lifecycle = [(e["type"], e["output_index"]) for e in events
                 if e["type"].startswith("response.output_item.")]
    assert lifecycle == [(f"response.output_item.{kind}", i) for i in range(4)
                         for kind in ("added", "done")]
    arguments = "".join(e["delta"] for e in events
                        if e["type"] == "response.function_call_arguments.delta"
                        and e["output_index"] == 2)
    assert arguments == calls[0]["arguments"]


def test_blank_text_before_a_tool_call_makes_no_message():
    items = _items(reasoning=None)
    _feed(items, '\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', 2)
    assert [item["type"] for item in items.items] == ["function_call"]


def test_an_empty_answer_is_one_empty_message():
    items = _items(reasoning=None)
    events = _feed(items, "", 1)
    assert [item["type"] for item in items.items] == ["message"]
    assert items.items[0]["content"][0]["text"] == ""
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done"]


def test_a_truncated_answer_leaves_its_last_item_incomplete():
    items = _items(reasoning=None)
    items.feed("Cut sho", True)
    items.finish(is_truncated=True)
    assert items.items[0]["status"] == "incomplete"
