"""A `/v1/responses` request as the chat request that serves it (front end): `input` items
and `instructions` become chat messages, Responses' flat function tools become chat tools,
`text.format` becomes the chat request's `response_format`; what cannot be served is a 400
naming the field (or the item, as `input[i]`).
"""

from __future__ import annotations

from typing import Any, NoReturn

from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.openai.protocol import ChatCompletionRequest, ResponsesRequest
from gateway.frontend.openai.structured_output_limits import SpecLimits
from gateway.frontend.openai.structured_outputs import json_schema_params

#: The `include` value that asks for the output text's log-probabilities.
LOGPROBS = "message.output_text.logprobs"
#: Fields OpenAI or vLLM define for /v1/responses that this server cannot honour: refused
#: unless left at a value that asks for nothing: name -> (those values, why).
REFUSED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "background": ((None, False), "background responses are not supported"),
    "include": ((None, [], [LOGPROBS]), f"only {LOGPROBS!r} can be included"),
    "max_tool_calls": ((None,), "max_tool_calls is not supported"),
    "prompt": ((None,), "prompt templates are not supported"),
    "conversation": ((None,), "conversations are not supported; use previous_response_id"),
    "service_tier": ((None, "auto", "default"), "only the default service tier exists"),
    "truncation": ((None, "disabled"), "only truncation 'disabled' is supported"),
    "stream_options": ((None, {}, {"include_obfuscation": False}),
                       "stream obfuscation is not supported"),
    "cache_salt": ((None,), "cache_salt is not supported"),
    "mm_processor_kwargs": ((None, {}), "this model takes no multimodal input"),
    "enable_response_messages": ((False,), "raw response messages are not supported"),
    "previous_input_messages": ((None, []), "previous_input_messages is not supported; use "
                                "previous_response_id"),
}
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text")
_TOOL_FIELDS = {"type", "name", "description", "parameters", "strict"}
#: Function-tool fields OpenAI defines that are accepted at values that ask nothing.
_HARMLESS_TOOL_FIELDS: dict[str, tuple[Any, ...]] = {
    "defer_loading": (False, None), "allowed_callers": (None, ["direct"]),
    "output_schema": (None,)}


def check_responses_fields(body: ResponsesRequest) -> None:
    """Refuse what this server cannot do, by name, instead of ignoring it."""
    for name, (harmless, why) in REFUSED_FIELDS.items():
        value = getattr(body, name)
        if not any(value == ok and type(value) is type(ok) or value is ok
                   for ok in harmless):
            _refuse(name, f"{name}: {why}.")
    if body.stream_options is not None and not body.stream:
        _refuse("stream_options", "stream_options is only allowed with stream: true.")
    if body.top_logprobs and not has_logprobs(body):
        _refuse("top_logprobs", f"top_logprobs needs include: [{LOGPROBS!r}].")


def has_logprobs(body: ResponsesRequest) -> bool:
    """Whether the request asks for the output text's log-probabilities."""
    return LOGPROBS in (body.include or [])


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as chat messages (without the instructions)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    return items_as_messages(body.input, "input")


def items_as_messages(items: list[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    """Input or output items as chat messages (`param`: where the items came from)."""
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        _add_item(messages, item, f"{param}[{index}]")
    return messages


def chat_request(body: ResponsesRequest, conversation: list[dict[str, Any]],
                 limits: SpecLimits) -> ChatCompletionRequest:
    """The chat request that answers `body`, whose `conversation` is the previous
    response's (if any) and then its own input, as chat messages."""
    messages = list(conversation)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    if not messages:
        _refuse("input", "input must hold at least one message")
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "stream": bool(body.stream),
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "top_k": body.top_k, "logit_bias": body.logit_bias,
        "skip_special_tokens": body.skip_special_tokens, "priority": body.priority,
        "user": body.user, "parallel_tool_calls": body.parallel_tool_calls is not False}
    if has_logprobs(body):
        fields.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    tools = [_chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(body.tools or [])]
    if tools:
        fields["tools"] = tools
    if body.tool_choice is not None:
        fields["tool_choice"] = _chat_tool_choice(body.tool_choice, has_tools=bool(tools))
    response_format = _response_format(body.text, limits)
    if response_format is not None:
        fields["response_format"] = response_format
    effort = _reasoning_effort(body.reasoning)
    if effort is not None:
        fields["chat_template_kwargs"] = {"reasoning_effort": effort}
    return ChatCompletionRequest.model_validate(fields, strict=False)


#: How the chat path's errors name a field, and the field of /v1/responses it came from.
RESPONSES_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                    "max_tokens": "max_output_tokens", "response_format": "text.format",
                    "chat_template_kwargs": "reasoning"}


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], param: str) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        messages.append(_message(item, param))
    elif kind == "function_call":
        call = {"id": _string(item, "call_id", param), "type": "function",
                "function": {"name": _string(item, "name", param),
                             "arguments": _string(item, "arguments", param)}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)  # one turn, several calls
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param),
                         "content": _text(item.get("output"), f"{param}.output")})
    elif kind == "reasoning":
        # Earlier reasoning stays out of the prompt, as chat templates leave it out.
        if item.get("encrypted_content"):
            _refuse(f"{param}.encrypted_content", "encrypted reasoning is not supported")
    else:
        _refuse(param, f"{param}: input item type {_shown(kind)} is not supported; use "
                "'message', 'function_call', 'function_call_output' or 'reasoning'")


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        _refuse(f"{param}.role", f"{param}.role must be one of {', '.join(_ROLES)}, got "
                f"{_shown(role)}")
    return {"role": _ROLES[role], "content": _text(item.get("content"), f"{param}.content")}


def _text(content: Any, param: str) -> str:
    """A string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        _refuse(param, f"{param} must be a string or a list of input_text parts")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            _refuse(f"{param}[{index}]", f"{param}[{index}]: content part of type "
                    f"{_shown(kind)} is not supported; only text parts (input_text, "
                    "output_text) are")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        _refuse(f"{param}.{key}", f"{param} needs {key} as a string")
    return value


def _chat_tool(tool: Any, param: str) -> dict[str, Any]:
    """Responses' flat function tool as a chat tool."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        _refuse(param, f"{param}: tool type {_shown(kind)} is not supported; only "
                "'function' is")
    unknown = sorted(key for key in tool.keys() - _TOOL_FIELDS
                     if tool[key] not in _HARMLESS_TOOL_FIELDS.get(key, ()))
    if unknown:
        name = unknown[0][:40]
        _refuse(f"{param}.{name}", f"{param}: the tool field {name!r} is not supported")
    function = {key: tool[key] for key in ("name", "description", "parameters")
                if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any, *, has_tools: bool) -> Any:
    if choice in ("none", "auto", "required"):
        return None if choice == "auto" and not has_tools else choice
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    _refuse("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "name": ...}')


def _response_format(text: dict[str, Any] | None, limits: SpecLimits
                     ) -> dict[str, Any] | None:
    if not text:
        return None
    unknown = sorted(text.keys() - {"format", "verbosity"})
    if unknown:
        _refuse(f"text.{unknown[0][:40]}", f"text.{unknown[0][:40]} is not supported")
    if text.get("verbosity") is not None:
        _refuse("text.verbosity", "text.verbosity is not supported")
    spec = text.get("format")
    kind = spec.get("type") if isinstance(spec, dict) else None
    if spec is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if "schema" not in spec:
            _refuse("text.format", "text.format of type 'json_schema' needs schema")
        json_schema_params(spec["schema"], "text.format", limits)
        return {"type": "json_schema", "json_schema": {"name": spec.get("name") or "output",
                                                       "schema": spec["schema"]}}
    _refuse("text.format", f"text.format type {_shown(kind)} is not supported; use 'text', "
            "'json_object' or 'json_schema'")


def _reasoning_effort(reasoning: dict[str, Any] | None) -> str | None:
    if not reasoning:
        return None
    unknown = sorted(reasoning.keys() - {"effort", "summary", "generate_summary"})
    if unknown:
        name = unknown[0][:40]
        _refuse(f"reasoning.{name}", f"reasoning.{name} is not supported")
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) not in (None, "auto"):
            _refuse(f"reasoning.{key}", f"reasoning.{key}: reasoning summaries are not "
                    "made; the reasoning comes back as reasoning text")
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        _refuse("reasoning.effort", "reasoning.effort must be a string")
    return effort


def _shown(value: Any) -> str:
    """A client's value in an error message, cut short (it may be any length)."""
    return repr(value)[:40]


def _refuse(param: str, message: str) -> NoReturn:
    raise OpenAIError(400, message, param=param)
