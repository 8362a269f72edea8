"""The serve flags for tool calling and reasoning, and the parsers they choose (front end):
`--enable-auto-tool-choice`, `--tool-call-parser NAME`, `--tool-parser-plugin MODULE`,
`--reasoning-parser NAME` (vLLM's flags)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from gateway.frontend.openai.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from gateway.frontend.openai.tool_parsers import get_tool_parser, import_tool_parser_plugin
from gateway.frontend.server_config import OpenAIConfig


def add_chat_parser_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="let the model decide to call tools (tool_choice 'auto'); needs "
                       "--tool-call-parser")
    group.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="how tool calls are read from the model's text: hermes, json, "
                       "llama3_json, mistral, pythonic, qwen3_coder, or one a plugin "
                       "registers")
    group.add_argument("--tool-parser-plugin", default=None, metavar="MODULE",
                       help="a module (or .py file) imported at start-up that registers "
                       "tool parsers")
    group.add_argument("--reasoning-parser", default=None,
                       choices=sorted(REASONING_PARSERS),
                       help="split the model's <think> reasoning into reasoning_content")


@dataclass(frozen=True)
class ChatParsers:
    """What the flags chose; one per app."""

    tool_parser: type | None = None  # set only with --enable-auto-tool-choice
    reasoning_parser: type | None = None

    @classmethod
    def from_config(cls, config: OpenAIConfig) -> ChatParsers:
        """Resolve the flags; ValueError (start-up stops) for an unknown name or a flag
        without the one it needs."""
        if config.tool_parser_plugin:
            import_tool_parser_plugin(config.tool_parser_plugin)
        name = config.tool_call_parser
        if config.enable_auto_tool_choice and not name:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")
        tool_parser = get_tool_parser(name) if name else None
        reasoning = config.reasoning_parser
        return cls(tool_parser=tool_parser if config.enable_auto_tool_choice else None,
                   reasoning_parser=get_reasoning_parser(reasoning) if reasoning else None)
