"""Tool-call and reasoning parsers, whole and streamed: a streamed answer (fed in pieces of
any size) reassembles to exactly the non-streamed message."""

from __future__ import annotations

import json

import pytest

from gateway.frontend.openai.chat_output import AnswerParser, MessageStream, final_message
from gateway.frontend.openai.chat_parsers import ChatParsers
from gateway.frontend.openai.chat_tools import ToolPlan
from gateway.frontend.openai.reasoning_parsers import get_reasoning_parser
from gateway.frontend.openai.tool_parsers import ParsedToolCalls, ToolParser, get_tool_parser

HERMES_TWO_CALLS = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
                    '{"city": "Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": '
                    '"get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


def _parser(mode: str = "auto", tool_parser: str | None = "hermes",
            reasoning: str | None = None, parallel: bool = True,
            function: str | None = None) -> AnswerParser:
    parsers = ChatParsers(tool_parser=get_tool_parser(tool_parser) if tool_parser else None,
                          reasoning_parser=get_reasoning_parser(reasoning) if reasoning
                          else None)
    return AnswerParser(ToolPlan(mode=mode, function=function, parallel=parallel), parsers,
                        tokenizer=None)


def _stream(parser: AnswerParser, text: str, piece: int) -> tuple[dict, str | None]:
    """Feed `text` in pieces; reassemble the deltas into one message as a client would."""
    stream = MessageStream(parser)
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)] or [""]
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    for i, chunk in enumerate(pieces):
        for delta in stream.feed(chunk, is_final=i == len(pieces) - 1):
            message["content"] += delta.get("content", "")
            message["reasoning_content"] += delta.get("reasoning_content", "")
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["index"] == len(message["tool_calls"])
                    assert call["function"]["arguments"] == ""
                    message["tool_calls"].append({"id": call["id"], "name": call["function"]
                                                  ["name"], "arguments": ""})
                else:
                    message["tool_calls"][call["index"]]["arguments"] += \
                        call["function"]["arguments"]
    return message, stream.finish_reason("stop")


def test_hermes_reads_every_tool_call_and_the_text_before_them():
    message, finish = final_message(_parser(), HERMES_TWO_CALLS, "stop")
    assert finish == "tool_calls"
    assert message["content"] == "Let me look.\n"
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_streamed_hermes_calls_reassemble_to_the_whole_answer(piece):
    whole, whole_finish = final_message(_parser(), HERMES_TWO_CALLS, "stop")
    streamed, finish = _stream(_parser(), HERMES_TWO_CALLS, piece)
    assert finish == whole_finish == "tool_calls"
    assert streamed["content"] == whole["content"]
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"]] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]


def test_streamed_arguments_arrive_in_pieces_before_the_call_closes():
    stream = MessageStream(_parser())
    text = '<tool_call>{"name": "f", "arguments": {"query": "a long value'
    deltas = [d for ch in text for d in stream.feed(ch, is_final=False)]
    pieces = [d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d]
    assert len(pieces) > 5
    assert "".join(pieces) == '{"query": "a long value'


@pytest.mark.parametrize("text", ["Paris is the capital.", "I use <tool and <b>bold</b>",
                                  "<tool_call> not json </tool_call>"])
def test_text_without_a_valid_call_is_content(text, caplog):
    message, finish = final_message(_parser(), text, "stop")
    assert message["content"] == text and "tool_calls" not in message
    assert finish == "stop"
    streamed, _ = _stream(_parser(), text, 1)
    assert streamed["content"] == text and not streamed["tool_calls"]


def test_a_parser_that_raises_gives_the_text_as_content_with_a_warning(caplog):
    class Broken(ToolParser):
        def parse(self, text: str, *, is_final: bool) -> ParsedToolCalls:
            raise RuntimeError("boom")

    parser = AnswerParser(ToolPlan(mode="auto"), ChatParsers(tool_parser=Broken), None)
    with caplog.at_level("WARNING"):
        message, finish = final_message(parser, "<tool_call>{}</tool_call>", "stop")
    assert message["content"] == "<tool_call>{}</tool_call>" and finish == "stop"
    assert any("boom" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


@pytest.mark.parametrize("text,names", [
    ('{"name": "f", "arguments": {"x": 1}}', ["f"]),
    ('[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]', ["f", "g"]),
    ('{"arguments": {"x": 1}, "name": "f"}', ["f"]),
])
def test_json_parser_reads_an_object_or_a_list_of_calls(text, names):
    message, finish = final_message(_parser(tool_parser="json"), text, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == names
    assert finish == "tool_calls"
    streamed, _ = _stream(_parser(tool_parser="json"), text, 2)
    assert [c["arguments"] for c in streamed["tool_calls"]] == [
        c["function"]["arguments"] for c in message["tool_calls"]]


def test_required_mode_parses_the_constrained_array_and_parallel_false_keeps_one():
    text = '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]'
    message, _ = _stream(_parser(mode="required", tool_parser=None, parallel=False), text, 3)
    assert [c["name"] for c in message["tool_calls"]] == ["f"]


def test_named_function_answer_is_its_arguments_and_finishes_with_stop():
    message, finish = final_message(_parser(mode="named", function="f"), '{"x": 1}', "stop")
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert message["content"] is None and finish == "stop"


@pytest.mark.parametrize("name,text,reasoning,content", [
    ("deepseek_r1", "<think>Hmm, 2+2.</think>It is 4.", "Hmm, 2+2.", "It is 4."),
    ("deepseek_r1", "Hmm, 2+2.</think>It is 4.", "Hmm, 2+2.", "It is 4."),
    ("deepseek_r1", "still thinking", "still thinking", ""),
    ("qwen3", "<think>Hmm.</think>\n\nIt is 4.", "Hmm.", "\n\nIt is 4."),
    ("qwen3", "It is 4.", None, "It is 4."),
])
@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_reasoning_is_split_from_content_whole_and_streamed(name, text, reasoning, content,
                                                            piece):
    parser = _parser(mode="none", tool_parser=None, reasoning=name)
    message, _ = final_message(parser, text, "stop")
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    streamed, _ = _stream(_parser(mode="none", tool_parser=None, reasoning=name), text, piece)
    assert streamed["reasoning_content"] == (reasoning or "")
    assert streamed["content"] == content


def test_reasoning_then_hermes_tool_call():
    text = '<think>I need the weather.</think><tool_call>{"name": "w", "arguments": {}}</tool_call>'
    message, finish = final_message(_parser(reasoning="deepseek_r1"), text, "stop")
    assert message["reasoning_content"] == "I need the weather."
    assert message["tool_calls"][0]["function"]["name"] == "w" and finish == "tool_calls"
