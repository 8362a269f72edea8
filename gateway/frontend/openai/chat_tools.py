"""`tools`, `tool_choice` and `parallel_tool_calls` of a chat request (front end): checked,
turned into what the chat template sees and, for `required` or a named function, into a
JSON-schema constraint the engine enforces (as vLLM does).

tool_choice: `none` (no calls), `auto` (the model decides; its text is read by the
--tool-call-parser), `required` (the answer is constrained to a JSON array of calls),
`{"type": "function", "function": {"name": ...}}` (the answer is constrained to that
function's arguments). Default: `auto` when tools are given, else `none`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NoReturn

from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.openai.chat_parsers import ChatParsers
from gateway.frontend.openai.protocol import ChatCompletionRequest
from gateway.frontend.openai.structured_output_limits import SpecLimits, check_spec
from gateway.structured_outputs_params import StructuredOutputsParams

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's function-name rule (plus '.')
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """How one request's answer becomes tool calls."""

    mode: str = "none"  # "none" | "auto" | "required" | "named"
    function: str | None = None  # the named function
    parallel: bool = True
    tools: tuple[dict[str, Any], ...] = ()  # the functions' definitions, checked


def plan_tools(body: ChatCompletionRequest, parsers: ChatParsers) -> ToolPlan:
    """Check the tool fields; 400 naming the field for a bad one."""
    tools = tuple(_checked_tool(tool, i) for i, tool in enumerate(body.tools or []))
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            _refuse("tool_choice", f"tool_choice {choice!r} needs tools")
        if choice == "auto" and parsers.tool_parser is None:
            _refuse("tool_choice", '"auto" tool choice requires --enable-auto-tool-choice '
                    "and --tool-call-parser to be set")
        return ToolPlan(mode=choice, parallel=body.parallel_tool_calls, tools=tools)
    name = _named_choice(choice)
    if name not in {t["function"]["name"] for t in tools}:
        _refuse("tool_choice", f"tool_choice names function {name!r}, which is not in tools")
    return ToolPlan(mode="named", function=name, parallel=body.parallel_tool_calls,
                    tools=tools)


def tool_constraint(plan: ToolPlan) -> StructuredOutputsParams | None:
    """The JSON schema `required` and a named function are held to; None otherwise."""
    schema: dict[str, Any]
    if plan.mode == "named":
        (tool,) = [t for t in plan.tools if t["function"]["name"] == plan.function]
        schema = tool["function"].get("parameters") or _NO_PARAMETERS
    elif plan.mode == "required":
        calls = [{"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                 "parameters": t["function"].get("parameters") or _NO_PARAMETERS},
                  "required": ["name", "parameters"]} for t in plan.tools]
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
        if not plan.parallel:
            schema["maxItems"] = 1
    else:
        return None
    return StructuredOutputsParams(json=json.dumps(schema, ensure_ascii=False),
                                   source_param="tools")


def template_tools(plan: ToolPlan) -> list[dict[str, Any]] | None:
    """What the chat template gets as `tools` (None: the template sees no tools)."""
    return [dict(tool) for tool in plan.tools] or None


def _checked_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    param = f"tools[{index}]"
    if tool.get("type", "function") != "function":
        _refuse(param, f"tool type {tool.get('type')!r} is not supported; only 'function' is")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        _refuse(param, "a tool needs function.name")
    if not _NAME.match(function["name"]):
        _refuse(param, "function.name must be 1-64 letters, digits, '_', '-' or '.'")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        _refuse(param, "function.parameters must be a JSON schema object")
    return {"type": "function", "function": function}


def _named_choice(choice: Any) -> str:
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    _refuse("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}')


def _refuse(param: str, message: str) -> NoReturn:
    raise OpenAIError(400, message, param=param)


@dataclass(frozen=True)
class ChatAnswerSetup:
    """Everything tool calling, reasoning and structured outputs add to one chat request."""

    plan: ToolPlan
    template_tools: list[dict[str, Any]] | None
    structured_outputs: StructuredOutputsParams | None
    parsers: ChatParsers


def prepare_chat_answer(body: ChatCompletionRequest, parsers: ChatParsers | None,
                        limits: SpecLimits | None = None) -> ChatAnswerSetup:
    """Check the request's tool and constraint fields (400s naming them; `limits`: the
    size caps of an output constraint)."""
    from gateway.frontend.openai.structured_outputs import structured_outputs_of

    parsers = parsers or ChatParsers()
    limits = limits or SpecLimits()
    plan = plan_tools(body, parsers)
    constraint = structured_outputs_of(body, limits)
    tools_constraint = tool_constraint(plan)
    if tools_constraint is not None:
        check_spec(tools_constraint, limits)
    if constraint is not None and tools_constraint is not None:
        _refuse("tool_choice", f"tool_choice {plan.mode!r} constrains the answer already; it "
                f"cannot be combined with {constraint.source_param}")
    return ChatAnswerSetup(plan, template_tools(plan), constraint or tools_constraint,
                           parsers)
