"""`/v1/responses` through the real server and the openai SDK's `client.responses.create`:
text and message items in, message and function_call items out, `text.format` through the
structured-output path, a tool round trip read by the llama3_json parser, and 400s that
name the bad field or item. The tiny random model is held to the text a test needs by
`text.format` (a JSON schema with one possible value) or `tool_choice`."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.frontend.conftest import SERVED_NAME, tiny_server

pytestmark = pytest.mark.e2e

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Rome"]}},
               "required": ["city"], "additionalProperties": False}, "strict": True}
CITY_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]},
    "sunny": {"type": "boolean"}}, "required": ["city", "sunny"], "additionalProperties": False}
#: The one text llama3_json reads as a call of get_weather(city="Paris").
FORCED_CALL = {"const": {"name": "get_weather", "parameters": {"city": "Paris"}}}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "responses-server.log"
    with tiny_server(tiny_model, "--enable-auto-tool-choice", "--tool-call-parser",
                     "llama3_json", log_path=log) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url(""), timeout=120) as http:
        yield http


@pytest.fixture(scope="module")
def no_whitespace(tiny_model) -> dict[str, float]:
    """vLLM's `logit_bias` extra that keeps the random model from writing the whitespace a
    JSON grammar allows between tokens (it could write nothing else)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    blank = [i for i in range(tokenizer.get_vocab_size())
             if tokenizer.decode([i]) and not tokenizer.decode([i]).strip()]
    assert blank
    return {str(i): -100.0 for i in blank}


def _json_format(schema: dict) -> dict:
    return {"format": {"type": "json_schema", "name": "answer", "schema": schema,
                       "strict": True}}


def _prompt_tokens(http: httpx.Client, messages: list[dict]) -> int:
    response = http.post("/tokenize", json={"model": SERVED_NAME, "messages": messages})
    assert response.status_code == 200, response.text
    return response.json()["count"]


def test_a_text_input_is_answered_with_a_message_item_and_usage(client, http):
    response = client.responses.create(model=SERVED_NAME, input="Hello there",
                                       max_output_tokens=6, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert [item.type for item in response.output] == ["message"]
    message = response.output[0]
    assert message.role == "assistant" and message.content[0].type == "output_text"
    assert response.output_text == message.content[0].text
    usage = response.usage
    assert usage.input_tokens == _prompt_tokens(http, [{"role": "user",
                                                        "content": "Hello there"}])
    assert 1 <= usage.output_tokens <= 6
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if usage.output_tokens == 6:  # cut short by max_output_tokens
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"
    assert response.temperature == 0 and response.max_output_tokens == 6


def test_message_items_and_instructions_render_as_the_chat_messages(client, http):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hello"},
                                          {"type": "input_text", "text": "there"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hi."}]},
             {"role": "developer", "content": "Be brief."},
             {"role": "user", "content": "Again"}]
    response = client.responses.create(model=SERVED_NAME, input=items, temperature=0,
                                       instructions="You are terse.", max_output_tokens=4)
    chat = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello\nthere"},
            {"role": "assistant", "content": "Hi."},
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Again"}]
    assert response.usage.input_tokens == _prompt_tokens(http, chat)
    assert response.instructions == "You are terse."
    # The chat route answers the same messages with the same text (both greedy).
    completion = client.chat.completions.create(model=SERVED_NAME, messages=chat,
                                                temperature=0, max_completion_tokens=4)
    assert response.output_text == completion.choices[0].message.content


def test_text_format_json_schema_returns_json_of_the_schema(client, no_whitespace):
    response = client.responses.create(model=SERVED_NAME, input="Weather?",
                                       text=_json_format(CITY_SCHEMA), temperature=0,
                                       max_output_tokens=60,
                                       extra_body={"logit_bias": no_whitespace})
    assert response.status == "completed"
    value = json.loads(response.output_text)
    assert set(value) == {"city", "sunny"}
    assert value["city"] in ("Paris", "Rome") and isinstance(value["sunny"], bool)
    assert response.text.format.type == "json_schema"


def test_a_tool_call_round_trip_with_the_llama3_json_parser(client, http):
    question = {"role": "user", "content": "Weather in Paris?"}
    first = client.responses.create(model=SERVED_NAME, input=[question], tools=[WEATHER],
                                    text=_json_format(FORCED_CALL), max_output_tokens=60)
    assert [item.type for item in first.output] == ["function_call"]
    call = first.output[0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id and call.id and call.status == "completed"
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": "Sunny, 24 degrees"}
    second = client.responses.create(
        model=SERVED_NAME, input=[question, call.model_dump(exclude_none=True), result],
        tools=[WEATHER], tool_choice="none", max_output_tokens=4, temperature=0)
    assert second.output[0].type == "message"
    assert second.usage.input_tokens == _prompt_tokens(http, [
        question,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 24 degrees"}])


def test_a_named_tool_choice_returns_that_function_call(client):
    response = client.responses.create(
        model=SERVED_NAME, input="Weather?", tools=[WEATHER], max_output_tokens=40,
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                              "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}}, "text.format"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
    ({"tool_choice": "auto", "tools": [WEATHER], "max_output_tokens": 100000},
     "max_output_tokens"),
    ({"stream": True}, "stream"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
])
def test_what_cannot_be_served_is_a_400_naming_it(http, fields, param):
    body = {"model": SERVED_NAME, "input": "Hi", **fields}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_an_unknown_item_type_is_named_in_the_sdk_error(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=SERVED_NAME,
                                input=[{"type": "item_reference", "id": "msg_1"}])
    assert "item_reference" in caught.value.message
