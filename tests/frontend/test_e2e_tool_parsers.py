"""A family's tool parser through the real server and the openai SDK: the tiny model is
held (structured outputs `choice`) to what Qwen3-Coder's template writes for two calls, and
`--tool-call-parser qwen3_coder` turns it into OpenAI tool calls, whole and streamed."""

from __future__ import annotations

import json

import openai
import pytest

from tests.frontend.conftest import SERVED_NAME, tiny_server
from tests.frontend.test_tool_parser_families import CALLS, TOOLS, _transcript

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def client(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "tool-parser-server.log"
    with tiny_server(tiny_model, "--enable-auto-tool-choice", "--tool-call-parser",
                     "qwen3_coder", log_path=log) as server:
        yield openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0,
                            timeout=120)


def _request(text: str, **extra) -> dict:
    return {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Weather?"}],
            "tools": list(TOOLS), "max_completion_tokens": 400,
            "extra_body": {"structured_outputs": {"choice": [text]}}, **extra}


def test_qwen3_coder_calls_come_back_as_openai_tool_calls(client):
    text = "Checking.\n" + _transcript("qwen3_coder", CALLS)
    choice = client.chat.completions.create(**_request(text)).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking.\n"
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == CALLS


def test_streamed_qwen3_coder_calls_are_openai_deltas(client):
    text = _transcript("qwen3_coder", CALLS)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**_request(text), stream=True):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        assert not chunk.choices[0].delta.content
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id:
                assert delta.index not in calls and delta.type == "function"
                calls[delta.index] = {"name": delta.function.name, "arguments": ""}
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] \
        == CALLS
