"""Tool parsers a user adds without forking: an entry point in `vllm.tool_parsers`, or
a `--tool-parser-plugin` module (here a real installed distribution and a real file)."""

from __future__ import annotations

import pytest

from gateway.frontend.openai.chat_output import AnswerParser, final_message
from gateway.frontend.openai.chat_parsers import ChatParsers
from gateway.frontend.openai.chat_tools import ToolPlan
from gateway.frontend.openai.tool_parsers import TOOL_PARSERS_GROUP
from gateway.frontend.server_config import OpenAIConfig
from tests.plugin_dists import activate, forget_modules, write_dist

PARSER_SOURCE = '''
from gateway.frontend.openai.tool_parsers import (
    ParsedToolCalls, ToolCallPart, ToolParser, register_tool_parser)

@register_tool_parser("{name}")
class CallLineParser(ToolParser):
    """CALL name {{json}} on one line."""
    def parse(self, text, *, is_final):
        if not is_final:
            return ParsedToolCalls()
        if text.startswith("CALL "):
            name, arguments = text[5:].split(" ", 1)
            return ParsedToolCalls(tool_calls=[ToolCallPart(name, arguments, True)])
        return ParsedToolCalls(content=text)
'''


def _config(**flags) -> OpenAIConfig:
    return OpenAIConfig(**{"enable_auto_tool_choice": True, **flags})


def _call(parsers: ChatParsers, text: str):
    parser = AnswerParser(ToolPlan(mode="auto"), parsers, tokenizer=None)
    return final_message(parser, text, "stop")


def test_an_entry_point_parser_is_found_by_its_name(site, monkeypatch):
    write_dist(site, "call-line-parser", {TOOL_PARSERS_GROUP: {
        "call_line_ep": "call_line_ep_mod:CallLineParser"}},
        {"call_line_ep_mod": PARSER_SOURCE.format(name="call_line_ep_registered")})
    activate(site, monkeypatch)
    try:
        parsers = ChatParsers.from_config(_config(tool_call_parser="call_line_ep"))
        message, finish = _call(parsers, 'CALL lookup {"q": "x"}')
    finally:
        forget_modules("call_line_ep_mod")
    assert message["tool_calls"][0]["function"] == {"name": "lookup", "arguments": '{"q": "x"}'}
    assert finish == "tool_calls"


def test_a_tool_parser_plugin_file_registers_its_parser(tmp_path):
    path = tmp_path / "my_parsers.py"
    path.write_text(PARSER_SOURCE.format(name="call_line_file"))
    parsers = ChatParsers.from_config(_config(tool_call_parser="call_line_file",
                                          tool_parser_plugin=str(path)))
    message, _ = _call(parsers, "CALL f {}")
    assert message["tool_calls"][0]["function"]["name"] == "f"


@pytest.mark.parametrize("flags,needle", [
    ({"tool_call_parser": "no_such_parser"}, "hermes"),
    ({"tool_call_parser": None}, "--tool-call-parser"),
    ({"tool_call_parser": "hermes", "tool_parser_plugin": "/no/such/file.py"}, "no such file"),
])
def test_bad_parser_flags_stop_start_up_with_a_clear_error(flags, needle):
    with pytest.raises(ValueError, match=needle):
        ChatParsers.from_config(_config(**flags))


def test_without_auto_tool_choice_no_parser_reads_the_text():
    parsers = ChatParsers.from_config(_config(tool_call_parser="hermes",
                                          enable_auto_tool_choice=False))
    assert parsers.tool_parser is None
