"""Tool-call parsers (front end): text the model wrote -> OpenAI tool calls."""

from gateway.frontend.openai.tool_parsers.base import ParsedToolCalls, ToolCallPart, ToolParser
from gateway.frontend.openai.tool_parsers.registry import (
    TOOL_PARSERS_GROUP,
    get_tool_parser,
    import_tool_parser_plugin,
    register_tool_parser,
    tool_parser_names,
)

__all__ = ["TOOL_PARSERS_GROUP", "ParsedToolCalls", "ToolCallPart", "ToolParser",
           "get_tool_parser", "import_tool_parser_plugin", "register_tool_parser",
           "tool_parser_names"]
