"""End to end on the default model (SmolLM2-135M-Instruct, greedy), through the real server
and real clients: structured outputs and tool calls as applications use them."""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.plugin_dists import subprocess_env
from tests.server import ServerProcess

pytestmark = pytest.mark.e2e

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                             "maxLength": 12}},
                   "required": ["zone"]}}}


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "structured-server.log"
    env = subprocess_env()
    env.pop("VLLM_API_KEY", None)
    flags = ["--max-model-len", "1024", "--kv-cache-memory", "128MiB",
             "--disable-uvicorn-access-log", "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    with ServerProcess(flags, env=env, log_path=log) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _ask(text):
    return [{"role": "user", "content": text}]


def test_parse_with_a_pydantic_model_returns_a_validating_object(client, model):
    completion = client.chat.completions.parse(
        model=model, messages=_ask("Name a city in France and its country, as JSON."),
        response_format=City, temperature=0, max_completion_tokens=60)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_answer_parses(client, model):
    result = client.chat.completions.create(
        model=model, messages=_ask('Repeat this JSON exactly: {"city": "Paris", "country": '
                                   '"France"}'), temperature=0,
        max_completion_tokens=40, response_format={"type": "json_object"})
    assert result.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(result.choices[0].message.content), dict)


@pytest.mark.parametrize("constraint,check", [
    ({"regex": r"[A-Z][a-z]{1,9}, [0-9]{4}"},
     lambda text: re.fullmatch(r"[A-Z][a-z]{1,9}, [0-9]{4}", text)),
    ({"choice": ["Paris", "London", "Berlin"]},
     lambda text: text in ("Paris", "London", "Berlin")),
    ({"grammar": 'root ::= answer "."\nanswer ::= "yes" | "no"'},
     lambda text: text in ("yes.", "no.")),
])
def test_regex_choice_and_grammar_are_followed_exactly(client, model, constraint, check):
    result = client.chat.completions.create(
        model=model, messages=_ask("What is the capital of France?"), temperature=0,
        max_completion_tokens=20, extra_body={"structured_outputs": constraint})
    assert result.choices[0].finish_reason == "stop"
    assert check(result.choices[0].message.content), result.choices[0].message.content


def test_completions_take_the_older_guided_fields(client, model):
    result = client.completions.create(
        model=model, prompt="The capital of France is", temperature=0, max_tokens=10,
        extra_body={"guided_choice": [" Paris", " Rome"]})
    assert result.choices[0].text in (" Paris", " Rome")
    assert result.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body,param", [
    ({"structured_outputs": {"regex": "[unclosed"}}, "structured_outputs.regex"),
    ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 7}}}}}},
     "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "no_such_key": 1}}, "structured_outputs"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_an_invalid_constraint_is_a_400_naming_the_field(server, model, body, param, stream):
    response = httpx.post(server.url("/v1/chat/completions"), timeout=120, json={
        "model": model, "messages": _ask("hi"), "max_tokens": 5, "stream": stream, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param)


def test_sixteen_concurrent_requests_with_different_schemas_and_free_ones_all_hold(
        client, model):
    def schema(i):
        return {"type": "object", "properties": {f"field_{i}": {"type": "integer"},
                                                 "label": {"type": "string", "maxLength": 10}},
                "required": [f"field_{i}", "label"], "additionalProperties": False}

    def run(i):
        kind = i % 3
        extra = ({"response_format": {"type": "json_schema",
                                      "json_schema": {"name": f"s{i}", "schema": schema(i)}}}
                 if kind == 0 else {"extra_body": {"structured_outputs": {
                     "choice": [f"red {i}", f"blue {i}"]}}} if kind == 1 else {})
        prompt = (f'Repeat this JSON exactly: {{"field_{i}": {i}, "label": "item {i}"}}'
                  if kind == 0 else f"Give me item number {i}.")
        result = client.chat.completions.create(
            model=model, messages=_ask(prompt), temperature=0, max_completion_tokens=30,
            **extra)
        return i, kind, result.choices[0]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, range(16)))
    for i, kind, choice in results:
        text = choice.message.content
        if kind == 0:
            assert choice.finish_reason == "stop", text
            value = json.loads(text)
            assert set(value) == {f"field_{i}", "label"} and isinstance(value[f"field_{i}"], int)
        elif kind == 1:
            assert text in (f"red {i}", f"blue {i}")
        else:
            assert text and choice.finish_reason == "length"  # free text, cut at 30


def test_reasoning_is_split_from_content_whole_and_streamed(client, model):
    # The default model does not think; a regex makes it write a <think> block.
    request = dict(model=model, messages=_ask("What is two plus two?"), temperature=0,
                   max_completion_tokens=30, extra_body={"structured_outputs": {
                       "regex": "<think>[a-z ]{1,12}</think>[A-Z][a-z]{1,6}"}})
    whole = client.chat.completions.create(**request).choices[0].message
    assert re.fullmatch("[a-z ]{1,12}", whole.reasoning_content)
    assert re.fullmatch("[A-Z][a-z]{1,6}", whole.content)
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **request):
        delta = chunk.choices[0].delta if chunk.choices else None
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += (delta.content or "") if delta else ""
    assert (reasoning, content) == (whole.reasoning_content, whole.content)


def _stream_tool_calls(client, **request):
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
            if call.id:
                entry["id"], entry["name"] = call.id, call.function.name
            entry["arguments"] += call.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice,finish_reason", [
    ("required", "tool_calls"),
    ({"type": "function", "function": {"name": "get_weather"}}, "stop"),
])
def test_enforced_tool_calls_stream_to_the_same_arguments_as_whole(client, model, tool_choice,
                                                                   finish_reason):
    request = dict(model=model, messages=_ask("What is the weather in Paris?"),
                   tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=tool_choice, temperature=0,
                   max_completion_tokens=60)
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == finish_reason
    calls = whole.message.tool_calls
    assert calls and calls[0].id.startswith("chatcmpl-tool-")
    assert calls[0].type == "function"
    for call in calls:
        assert call.function.name in ("get_weather", "get_time")
        json.loads(call.function.arguments)
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in calls] == ["get_weather"]
        assert set(json.loads(calls[0].function.arguments)) == {"city", "unit"}
    streamed, streamed_finish = _stream_tool_calls(client, **request)
    assert streamed_finish == finish_reason
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls]
    assert all(c["id"] for c in streamed)


def test_tool_message_round_trip_reaches_the_template(client, model):
    first = client.chat.completions.create(
        model=model, messages=_ask("What is the weather in Paris?"), tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_completion_tokens=40).choices[0].message
    call = first.tool_calls[0]
    messages = _ask("What is the weather in Paris?") + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees celsius"}]
    answer = client.chat.completions.create(model=model, messages=messages,
                                            tools=[WEATHER_TOOL], tool_choice="none",
                                            temperature=0, max_completion_tokens=10)
    assert answer.choices[0].message.content
    assert not answer.choices[0].message.tool_calls


def test_auto_tool_choice_without_a_call_answers_in_text(client, model):
    result = client.chat.completions.create(
        model=model, messages=_ask("Say hello."), tools=[WEATHER_TOOL], temperature=0,
        max_completion_tokens=10)
    choice = result.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function",
                                               "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0]"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_fields_are_a_400_naming_them(server, model, body, param):
    response = httpx.post(server.url("/v1/chat/completions"), timeout=60, json={
        "model": model, "messages": _ask("hi"), "max_tokens": 5, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def _langchain_model(server, model, max_tokens):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=server.url("/v1"), api_key="unused", model=model,
                      temperature=0, max_tokens=max_tokens, max_retries=0, timeout=300)


def test_langchain_with_structured_output_returns_the_pydantic_object(server, model):
    structured = _langchain_model(server, model, 40).with_structured_output(City)
    city = structured.invoke('Repeat this JSON exactly: {"name": "Paris", "country": "France"}')
    assert isinstance(city, City) and city.name


def test_langchain_bind_tools_then_a_tool_message_round_trip(server, model):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "Sunny, 24 degrees"

    question = HumanMessage("What is the weather in Paris?")
    forced = _langchain_model(server, model, 40).bind_tools([get_weather],
                                                            tool_choice="get_weather")
    call_message = forced.invoke([question])
    (call,) = call_message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    answer = _langchain_model(server, model, 10).bind_tools([get_weather]).invoke(
        [question, call_message, result])
    assert isinstance(answer.content, str) and answer.content
