"""The tool parsers of the model families (llama3_json, mistral, pythonic, qwen3_coder) on
what each family's own chat template writes for an assistant's calls: the calls come back,
whole and streamed in pieces of any size, in OpenAI's shape."""

from __future__ import annotations

import json
import re

import pytest

from gateway.frontend.openai.chat_output import AnswerParser, final_message
from gateway.frontend.openai.chat_parsers import ChatParsers
from gateway.frontend.openai.chat_tools import ToolPlan
from gateway.frontend.openai.protocol import ChatCompletionRequest
from gateway.frontend.openai.tool_parsers import get_tool_parser
from gateway.template_sandbox import render_template
from tests.frontend.test_chat_answer_parsing import _stream
from tests.frontend.tool_call_templates import FAMILIES

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
TOOLS = (WEATHER, TIME)
CALLS = [("get_weather", {"city": "Paris", "days": 3, "metric": True}),
         ("get_time", {"zone": "Europe/Paris"})]
#: What the pythonic template writes for each call (it quotes every value as text).
PYTHONIC_CALLS = [("get_weather", {"city": "Paris", "days": "3", "metric": "True"}),
                  ("get_time", {"zone": "Europe/Paris"})]


def _transcript(family: str, calls, content: str = "") -> str:
    """The assistant's turn as the family's template writes it for `calls`."""
    template, start, end = FAMILIES[family]
    messages = [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": content, "tool_calls": [
            {"id": f"call{i:05d}", "type": "function",
             "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in enumerate(calls)]}]
    text = render_template(template, {"messages": messages, "tools": list(TOOLS),
                                      "bos_token": "<s>", "eos_token": "</s>",
                                      "add_generation_prompt": False})
    begin = text.rindex(start) + len(start)
    return text[begin:text.index(end, begin)]


def _parser(name: str, parallel: bool = True) -> AnswerParser:
    parsers = ChatParsers(tool_parser=get_tool_parser(name))
    return AnswerParser(ToolPlan(mode="auto", parallel=parallel, tools=TOOLS), parsers,
                        tokenizer=None)


def _parser_name(family: str) -> str:
    return "mistral" if family.startswith("mistral") else family


CASES = [("llama3_json", CALLS[:1], CALLS[:1]), ("mistral", CALLS, CALLS),
         ("mistral_args", CALLS, CALLS), ("pythonic", CALLS, PYTHONIC_CALLS),
         ("qwen3_coder", CALLS, CALLS)]


@pytest.mark.parametrize("family,calls,expected", CASES)
def test_the_calls_a_familys_template_writes_are_read_back(family, calls, expected):
    text = _transcript(family, calls)
    message, finish = final_message(_parser(_parser_name(family)), text, "stop")
    assert finish == "tool_calls", text
    assert message["content"] is None
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("function", *call) for call in expected]
    assert len({c["id"] for c in message["tool_calls"]}) == len(expected)


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
@pytest.mark.parametrize("family,calls,expected", CASES)
def test_streamed_calls_reassemble_to_the_whole_answer(family, calls, expected, piece):
    text = _transcript(family, calls)
    name = _parser_name(family)
    whole, whole_finish = final_message(_parser(name), text, "stop")
    streamed, finish = _stream(_parser(name), text, piece)
    assert finish == whole_finish == "tool_calls"
    assert streamed["content"] == ""
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"]] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]


@pytest.mark.parametrize("family", ["mistral_args", "pythonic", "qwen3_coder"])
def test_text_before_the_calls_is_the_content(family):
    text = _transcript(family, CALLS, content="Let me check. ")
    message, _ = final_message(_parser(_parser_name(family)), text, "stop")
    assert message["content"].strip() == "Let me check."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    streamed, _ = _stream(_parser(_parser_name(family)), text, 3)
    assert streamed["content"] == message["content"]


@pytest.mark.parametrize("name", ["llama3_json", "mistral", "pythonic", "qwen3_coder"])
@pytest.mark.parametrize("text", ["Paris is the capital of France.",
                                  "[1] Paris, [2] Lyon", "{1: 2} is a set literal?"])
def test_a_plain_answer_is_content_whole_and_streamed(name, text):
    message, finish = final_message(_parser(name), text, "stop")
    assert message["content"] == text and "tool_calls" not in message and finish == "stop"
    streamed, _ = _stream(_parser(name), text, 1)
    assert streamed["content"] == text and not streamed["tool_calls"]


@pytest.mark.parametrize("name,text", [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city"'),
    ("mistral", "[TOOL_CALLS]get_weather"),
    ("pythonic", '[get_weather(city="Paris"'),
    ("pythonic", "[get_weather(city=paris_variable)]"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),
    ("qwen3_coder", "<tool_call>\nnot a function\n</tool_call>"),
])
def test_a_broken_call_gives_the_text_as_content_with_a_warning(name, text, caplog):
    with caplog.at_level("WARNING"):
        message, finish = final_message(_parser(name), text, "length")
    assert message["content"] == text and "tool_calls" not in message
    assert finish == "length"
    assert any(r.levelname == "WARNING" and "as content" in r.getMessage()
               for r in caplog.records)


def test_llama3_json_reads_several_calls_separated_by_semicolons_and_the_python_tag():
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_time", "parameters": {"zone": "CET"}}')
    message, _ = final_message(_parser("llama3_json"), text, "stop")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("get_weather", {"city": "Paris"}),
                                                ("get_time", {"zone": "CET"})]
    streamed, _ = _stream(_parser("llama3_json"), text, 4)
    assert [c["name"] for c in streamed["tool_calls"]] == ["get_weather", "get_time"]


def test_parallel_tool_calls_false_keeps_the_first_call():
    message, _ = final_message(_parser("qwen3_coder", parallel=False),
                               _transcript("qwen3_coder", CALLS), "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


def test_qwen3_coder_types_values_by_the_tools_schema_and_streams_each_parameter():
    text = _transcript("qwen3_coder", [("get_weather", {"city": "7", "days": 3})])
    arguments = json.loads(final_message(_parser("qwen3_coder"), text, "stop")[0]
                           ["tool_calls"][0]["function"]["arguments"])
    assert arguments == {"city": "7", "days": 3}  # "city" is a string in the schema
    pieces = [call["function"]["arguments"]
              for delta in _deltas("qwen3_coder", text) for call in delta.get("tool_calls", [])
              if "id" not in call]
    assert pieces == ['{"city": "7"', ', "days": 3', "}"]


def _deltas(name: str, text: str) -> list[dict]:
    from gateway.frontend.openai.chat_output import MessageStream

    stream = MessageStream(_parser(name))
    return [d for i, ch in enumerate(text) for d in stream.feed(ch, i == len(text) - 1)]


def test_mistral_call_ids_are_nine_letters_and_digits_and_its_marker_is_kept():
    message, _ = final_message(_parser("mistral"), _transcript("mistral", CALLS), "stop")
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in message["tool_calls"])
    tool_parser = get_tool_parser("mistral")(None)
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert tool_parser.adjust_request(body).skip_special_tokens is False
    chosen = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                   skip_special_tokens=True)
    assert tool_parser.adjust_request(chosen).skip_special_tokens is True
