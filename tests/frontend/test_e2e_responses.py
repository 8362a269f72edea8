"""`/v1/responses` through the real server and the openai SDK's `client.responses.create`:
text and message items in, message, function_call and reasoning items out, whole and as
the Responses API's events, `text.format` through the structured-output path, a tool round
trip read by the llama3_json parser, and 400s that name the bad field or item. The tiny
random model is held to the text a test needs by `text.format` (a JSON schema with one
possible value) or `tool_choice`."""

from __future__ import annotations

import json
import re
import time
from typing import get_args

import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent

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
    first = client.responses.create(model=SERVED_NAME, input=[question],
                                    tools=[{**WEATHER, "defer_loading": False}],
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
    ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}}, "text.format"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 99}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
    ({"tool_choice": "auto", "tools": [WEATHER], "max_output_tokens": 100000},
     "max_output_tokens"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1.0}, "temperature"),
])
def test_what_cannot_be_served_is_a_400_naming_it(http, fields, param):
    body = {"model": SERVED_NAME, "input": "Hi", **fields}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_a_field_nobody_defines_is_named_in_the_ignored_fields_header(http):
    response = http.post("/v1/responses", json={"model": SERVED_NAME, "input": "Hi",
                                                 "max_output_tokens": 1, "colour": "red"})
    assert response.status_code == 200, response.text
    assert response.headers["X-Ignored-Fields"] == "colour"


def test_an_unknown_item_type_is_named_in_the_sdk_error(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=SERVED_NAME,
                                input=[{"type": "item_reference", "id": "msg_1"}])
    assert "item_reference" in caught.value.message


# ------------------------------------------------------------------ streamed
#: The SDK's event classes (its stream picks one by the event's `type`).
EVENT_CLASSES = {get_args(cls.model_fields["type"].annotation)[0]: cls
                 for cls in get_args(get_args(ResponseStreamEvent)[0])}
TEXT_ORDER = re.compile(
    r"response\.created response\.in_progress response\.output_item\.added "
    r"response\.content_part\.added (response\.output_text\.delta )+"
    r"response\.output_text\.done response\.content_part\.done response\.output_item\.done "
    r"response\.completed")
CALL_ORDER = re.compile(
    r"response\.created response\.in_progress response\.output_item\.added "
    r"(response\.function_call_arguments\.delta )+response\.function_call_arguments\.done "
    r"response\.output_item\.done response\.completed")


def _stream(client: openai.OpenAI, **fields) -> list:
    """Every event, each checked against the SDK's own event types, numbered from 0."""
    events = list(client.responses.create(model=SERVED_NAME, stream=True, **fields))
    for event in events:  # strictly valid, not just what the SDK's lenient reader made
        cls = EVENT_CLASSES[event.type]
        assert type(event) is cls
        cls.model_validate(event.model_dump(mode="json", by_alias=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    return events


def _types(events: list) -> str:
    return " ".join(event.type for event in events)


def test_streamed_text_comes_as_the_responses_events_in_order(client):
    fields = {"input": "Hello there", "max_output_tokens": 8, "temperature": 0}
    events = _stream(client, **fields)
    assert TEXT_ORDER.fullmatch(_types(events)), _types(events)
    created, completed = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.usage is None
    assert created.id == completed.id
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    added, done = events[2].item, events[-2].item
    assert added.id == done.id == completed.output[0].id and added.status == "in_progress"
    assert done.content[0].text == text == completed.output_text
    # The whole answer is the non-streamed one (both greedy).
    whole = client.responses.create(model=SERVED_NAME, **fields)
    assert whole.output_text == text and whole.usage == completed.usage
    assert whole.status == completed.status
    assert client.responses.retrieve(completed.id) == completed  # kept, as streamed


def test_a_streamed_tool_call_comes_as_function_call_events(client):
    events = _stream(client, input="Weather in Paris?", tools=[WEATHER],
                     text=_json_format(FORCED_CALL), max_output_tokens=60)
    assert CALL_ORDER.fullmatch(_types(events)), _types(events)
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"city": "Paris"}
    assert events[-3].arguments == arguments
    (call,) = events[-1].response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.arguments == arguments and call.id == events[2].item.id


def test_an_engine_side_400_comes_before_the_stream_starts(http):
    response = http.post("/v1/responses", json={
        "model": SERVED_NAME, "input": "Hi", "stream": True,
        "text": {"format": {"type": "json_schema", "name": "x",
                            "schema": {"type": "string", "pattern": "(unclosed"}}}})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "text.format"


def test_the_output_text_logprobs_when_included_whole_and_streamed(client):
    fields = {"input": "Hello", "max_output_tokens": 5, "temperature": 0,
              "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    whole = client.responses.create(model=SERVED_NAME, **fields)
    logprobs = whole.output[0].content[0].logprobs
    assert len(logprobs) == whole.usage.output_tokens
    for entry in logprobs:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy
    events = _stream(client, **fields)
    streamed = [entry for e in events if e.type == "response.output_text.delta"
                for entry in e.logprobs]
    assert [e.token for e in streamed] == [e.token for e in logprobs]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in logprobs])
    final = events[-1].response.output[0].content[0].logprobs
    assert [e.token for e in final] == [e.token for e in streamed]


# ------------------------------------------------------------------ stored responses
def test_previous_response_id_continues_the_conversation(client, http):
    first = client.responses.create(model=SERVED_NAME, input="Hello", temperature=0,
                                    instructions="Be terse.", max_output_tokens=4)
    assert first.store is True
    second = client.responses.create(model=SERVED_NAME, input="More",
                                     previous_response_id=first.id, max_output_tokens=4)
    assert second.previous_response_id == first.id
    said = [{"role": "user", "content": "Hello"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "More"}]
    # The instructions stay with the response that had them, as in OpenAI's API.
    assert second.usage.input_tokens == _prompt_tokens(http, said)
    third = client.responses.create(model=SERVED_NAME, input="Again",
                                    previous_response_id=second.id, max_output_tokens=4)
    assert third.usage.input_tokens == _prompt_tokens(http, said + [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Again"}])
    assert client.responses.retrieve(first.id) == first
    refused = http.get(f"/v1/responses/{first.id}", params={"stream": "true"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"


def test_a_function_call_output_answers_a_stored_function_call(client, http):
    question = {"role": "user", "content": "Weather in Paris?"}
    first = client.responses.create(model=SERVED_NAME, input=[question], tools=[WEATHER],
                                    text=_json_format(FORCED_CALL), max_output_tokens=60)
    (call,) = first.output
    second = client.responses.create(
        model=SERVED_NAME, previous_response_id=first.id, tools=[WEATHER],
        tool_choice="none", max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}])
    assert second.usage.input_tokens == _prompt_tokens(http, [
        question,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"}])


def test_a_response_with_store_false_is_not_kept(client, http):
    response = client.responses.create(model=SERVED_NAME, input="Hi", store=False,
                                       max_output_tokens=2)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    answer = http.post("/v1/responses", json={"model": SERVED_NAME, "input": "Hi",
                                              "previous_response_id": response.id})
    assert answer.status_code == 404
    assert answer.json()["error"]["param"] == "previous_response_id"


def _aborted(http: httpx.Client) -> float:
    """vllm:request_success_total for finished_reason="abort", from /metrics."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no abort series in /metrics")


def test_a_client_leaving_a_response_stream_aborts_its_request(server, http):
    no_end = {str(i): -100.0 for i in range(3)}  # the special tokens: no early end
    body = {"model": SERVED_NAME, "input": "x", "max_output_tokens": 1500, "stream": True,
            "logit_bias": no_end}
    aborted = _aborted(http)
    with httpx.Client(timeout=60) as other, \
            other.stream("POST", server.url("/v1/responses"), json=body) as response:
        lines = response.iter_lines()
        while "output_text.delta" not in next(lines):
            pass
    deadline = time.monotonic() + 30
    while _aborted(http) < aborted + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _aborted(http) == aborted + 1


# ------------------------------------------------------------------ reasoning
@pytest.fixture(scope="module")
def reasoning_client(tiny_model, tmp_path_factory):
    """A server whose reasoning parser (deepseek_r1) reads an answer without `</think>`
    as all reasoning: whatever the random model writes is reasoning. It keeps two
    responses at most."""
    log = tmp_path_factory.mktemp("logs") / "responses-reasoning-server.log"
    with tiny_server(tiny_model, "--reasoning-parser", "deepseek_r1",
                     "--responses-store-max-entries", "2", log_path=log) as server:
        yield openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0,
                            timeout=120)


def test_the_reasoning_parser_gives_a_reasoning_item(reasoning_client):
    fields = {"input": "Think.", "max_output_tokens": 8, "temperature": 0}
    response = reasoning_client.responses.create(model=SERVED_NAME, **fields)
    (item,) = response.output
    assert item.type == "reasoning" and item.summary == []
    assert item.content[0].type == "reasoning_text" and item.content[0].text.strip()
    assert 0 < response.usage.output_tokens_details.reasoning_tokens \
        <= response.usage.output_tokens
    events = _stream(reasoning_client, **fields)
    kinds = _types(events)
    assert kinds.startswith("response.created response.in_progress "
                            "response.output_item.added response.content_part.added "
                            "response.reasoning_text.delta"), kinds
    assert kinds.endswith("response.reasoning_text.done response.content_part.done "
                          "response.output_item.done response.completed"), kinds
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == item.content[0].text == events[-1].response.output[0].content[0].text


def test_the_store_keeps_the_newest_responses_up_to_its_bound(reasoning_client):
    ids = [reasoning_client.responses.create(model=SERVED_NAME, input="Hi",
                                             max_output_tokens=1).id for _ in range(3)]
    with pytest.raises(openai.NotFoundError):
        reasoning_client.responses.retrieve(ids[0])
    assert [reasoning_client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
