"""The size caps of a structured-output constraint, checked in the front end before anything
reaches the engine: each a 400 naming the field and the cap."""

from __future__ import annotations

import json

import pytest

from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.openai.protocol import ChatCompletionRequest
from gateway.frontend.openai.structured_output_limits import SpecLimits
from gateway.frontend.openai.structured_outputs import structured_outputs_of

LIMITS = SpecLimits(max_bytes=4096, max_enum_values=100, max_depth=8)


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def _refused(fields: dict, limits: SpecLimits = LIMITS) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        structured_outputs_of(_request(**fields), limits)
    assert caught.value.status == 400
    return caught.value


ENUM = {"type": "object", "properties": {"v": {"enum": [f"v{i}" for i in range(101)]}}}


@pytest.mark.parametrize("fields,param,flag", [
    ({"structured_outputs": {"json": ENUM}}, "structured_outputs.json",
     "--structured-outputs-max-enum-values"),
    ({"guided_json": json.dumps(ENUM)}, "guided_json", "--structured-outputs-max-enum-values"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                  "schema": ENUM}}},
     "response_format", "--structured-outputs-max-enum-values"),
    ({"structured_outputs": {"choice": [f"c{i}" for i in range(101)]}},
     "structured_outputs.choice", "--structured-outputs-max-enum-values"),
    ({"guided_regex": "a" * 4097}, "guided_regex", "--structured-outputs-max-bytes"),
    ({"structured_outputs": {"grammar": 'root ::= "' + "a" * 4096 + '"'}},
     "structured_outputs.grammar", "--structured-outputs-max-bytes"),
    ({"guided_json": {"type": "string", "description": "é" * 2100}}, "guided_json",
     "--structured-outputs-max-bytes"),  # bytes, not characters
    ({"structured_outputs": {"json": _nested(8)}}, "structured_outputs.json",
     "--structured-outputs-max-depth"),
])
def test_a_constraint_past_a_cap_is_a_400_naming_the_field_and_the_cap(fields, param, flag):
    error = _refused(fields)
    assert error.param == param and flag in error.message


def test_a_constraint_within_the_caps_passes():
    params = structured_outputs_of(_request(structured_outputs={"json": _nested(2)}), LIMITS)
    assert params is not None and params.source_param == "structured_outputs.json"
    enum = {"enum": [f"v{i}" for i in range(100)]}
    assert structured_outputs_of(_request(guided_json=enum), LIMITS) is not None


def test_the_default_caps_refuse_a_100000_value_enum():
    schema = {"type": "object", "properties": {"v": {"enum": list(range(100_000))}}}
    error = _refused({"structured_outputs": {"json": schema}}, SpecLimits())
    assert "100000 enum values" in error.message


@pytest.mark.parametrize("text,reason", [
    ("[" * 3000 + "]" * 3000, "nests deeper"),  # a RecursionError in json.loads before
    ("{not json", "not valid JSON"),
])
def test_schema_text_that_is_too_deep_or_not_json_is_a_400(text, reason):
    for fields, param in (({"structured_outputs": {"json": text}}, "structured_outputs.json"),
                          ({"guided_json": text}, "guided_json")):
        error = _refused(fields, SpecLimits())
        assert error.param == param and reason in error.message


def test_a_tool_schema_is_held_to_the_same_caps():
    from gateway.frontend.openai.chat_parsers import ChatParsers
    from gateway.frontend.openai.chat_tools import prepare_chat_answer

    tool = {"type": "function", "function": {"name": "f", "parameters": ENUM}}
    body = _request(tools=[tool], tool_choice="required")
    with pytest.raises(OpenAIError) as caught:
        prepare_chat_answer(body, ChatParsers(), SpecLimits(max_enum_values=100))
    assert caught.value.param == "tools" and "enum values" in caught.value.message
