"""A /v1/responses request as the chat request that serves it: items to messages, flat
tools to chat tools, text.format to response_format, reasoning.effort to the template."""

from __future__ import annotations

import pytest

from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.openai.protocol import ResponsesRequest
from gateway.frontend.openai.responses_input import chat_request, input_messages
from gateway.frontend.openai.structured_output_limits import SpecLimits

TOOL = {"type": "function", "name": "f", "description": "F.", "strict": True,
        "parameters": {"type": "object", "properties": {}}}


def _chat(**fields):
    body = ResponsesRequest.model_validate({"input": "Hi", **fields})
    return chat_request(body, input_messages(body), SpecLimits())


def test_calls_of_one_turn_join_the_assistant_message_before_them():
    body = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "Q"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "one"}]}]})
    messages = input_messages(body)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["content"] == "Looking."
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "one"}


def test_tools_choice_format_and_effort_become_the_chat_fields():
    chat = _chat(tools=[TOOL], tool_choice={"type": "function", "name": "f"},
                 text={"format": {"type": "json_object"}}, reasoning={"effort": "low"},
                 instructions="Sys", max_output_tokens=7)
    assert chat.tools == [{"type": "function", "function": {
        "name": "f", "description": "F.", "parameters": {"type": "object",
                                                         "properties": {}}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.response_format == {"type": "json_object"}
    assert chat.chat_template_kwargs == {"reasoning_effort": "low"}
    assert chat.messages[0].role == "system" and chat.messages[0].content == "Sys"
    assert chat.max_completion_tokens == 7


def test_auto_tool_choice_without_tools_asks_for_no_tools():
    assert _chat(tool_choice="auto").tool_choice is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                 "arguments": {}}]}, "input[0].arguments"),
    ({"input": [{"type": "reasoning", "encrypted_content": "x"}]},
     "input[0].encrypted_content"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"reasoning": {"effort": 3}}, "reasoning.effort"),
])
def test_a_field_that_cannot_be_served_is_named(fields, param):
    with pytest.raises(OpenAIError) as caught:
        _chat(**fields)
    assert caught.value.status == 400 and caught.value.param == param
