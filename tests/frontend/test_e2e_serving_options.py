"""End to end: the server-wide OpenAI settings on a real server: the model's generation
config as default sampling parameters, --chat-template and the chat-template controls,
fields nobody defines (logged, named in X-Ignored-Fields), and CORS before the API key.

One server: the tiny model with sampling defaults in its generation_config.json, a chat
template file, an API key, and one allowed origin.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from gateway.frontend.openai.serving import read_generation_defaults
from tests.frontend.conftest import tiny_server

pytestmark = pytest.mark.e2e

KEY = "test-key"
ORIGIN = "http://app.example"
TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.function.name }} {{ c.function.arguments.city }}>"
    "{% endfor %}{% if m.tool_call_id %}<id {{ m.tool_call_id }}>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}{{ greeting | default('') }}"
    "{% if fail %}{{ raise_exception('the template refused') }}{% endif %}")
DEFAULTS = {"temperature": 0.0, "repetition_penalty": 1.8}


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("defaults") / "model"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, **DEFAULTS}))
    return folder


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("options")
    (folder / "template.jinja").write_text(TEMPLATE)
    with tiny_server(model, "--dtype", "float32", "--chat-template",
                     str(folder / "template.jinja"), "--allowed-origins", json.dumps([ORIGIN]),
                     "--allow-credentials",
                     log_path=folder / "server.log", VLLM_API_KEY=KEY) as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url(), timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


def _text(http, **fields):
    body = {"prompt": "The quick brown fox jumps over the lazy dog. The quick brown",
            "max_tokens": 8, "ignore_eos": True, **fields}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


# ------------------------------------------------------------------ generation config
def test_the_models_generation_config_is_the_default_and_a_request_wins(http, server):
    assert _text(http) == _text(http, temperature=0.0, repetition_penalty=1.8)
    assert _text(http, repetition_penalty=1.0) != _text(http)
    assert "Using default chat sampling params from model: {'temperature': 0.0, " \
        "'repetition_penalty': 1.8}" in server.log_path.read_text()


@pytest.mark.parametrize(("mode", "expected"), [("auto", DEFAULTS), ("vllm", {})])
def test_generation_config_vllm_ignores_the_models(model, mode, expected):
    assert read_generation_defaults(model, mode) == expected


# ------------------------------------------------------------------ chat templates
def _rendered(http, messages, **fields):
    response = http.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 1, "return_token_ids": True, **fields})
    assert response.status_code == 200, response.text
    ids = response.json()["prompt_token_ids"]
    return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]


HELLO = [{"role": "user", "content": "Hi"}]


def test_the_chat_template_flag_replaces_the_models(http):
    assert _rendered(http, HELLO) == "[user]Hi[assistant]"


def test_chat_template_kwargs_reach_the_template(http):
    assert _rendered(http, HELLO, chat_template_kwargs={"greeting": "Hey"}).endswith("Hey")


def test_continue_final_message_continues_the_assistant(http):
    messages = HELLO + [{"role": "assistant", "content": "Once upon"}]
    rendered = _rendered(http, messages, continue_final_message=True,
                         add_generation_prompt=False)
    assert rendered == "[user]Hi[assistant]Once upon"
    plain = _rendered(http, messages, add_generation_prompt=False)
    assert plain == rendered  # nothing follows the last message in this template


def test_tool_call_history_reaches_the_template(http):
    messages = HELLO + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    rendered = _rendered(http, messages)
    assert "<call get_weather Paris>" in rendered
    assert "[tool]sunny<id call_1>" in rendered


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"chat_template_kwargs": {"fail": True}}, "messages", "--chat-template"),
    ({"chat_template": "{{ messages }}"}, "chat_template", "trust-request-chat-template"),
    ({"continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message", "both"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "messages"),
])
def test_template_problems_are_a_400_naming_them(http, fields, param, words):
    response = http.post("/v1/chat/completions", json={"messages": HELLO, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


# ------------------------------------------------------------------ ignored fields
def test_unknown_fields_are_named_in_a_header_and_logged_once(http, server):
    body = {"prompt": "Hi", "max_tokens": 1, "frobnicate": 1, "top_k": 3,
            "guided_json": None, "weird name\r\nX-Evil: 1": 2}
    for _ in range(2):
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200
        assert response.headers["x-ignored-fields"] == "frobnicate,weird%20name%0D%0AX-Evil%3A%201"
        assert "x-evil" not in response.headers
    log = server.log_path.read_text()
    assert log.count("'frobnicate' is not an OpenAI or vLLM field") == 1
    assert "'top_k'" not in log


def test_a_request_with_only_known_fields_has_no_header(http):
    response = http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 1})
    assert "x-ignored-fields" not in response.headers


# ------------------------------------------------------------------ CORS
def test_a_preflight_is_answered_before_the_api_key(server):
    response = httpx.options(server.url("/v1/chat/completions"), headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in response.headers["access-control-allow-methods"]


def test_credentials_are_allowed_only_to_the_listed_origin(server):
    """--allow-credentials with an explicit list: the listed origin may send cookies,
    another origin gets no CORS header at all."""
    response = httpx.get(server.url("/health"), headers={"Origin": ORIGIN,
                                                          "Cookie": "session=1"})
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert response.headers["access-control-allow-credentials"] == "true"
    other = httpx.get(server.url("/health"), headers={"Origin": "http://other.example",
                                                       "Cookie": "session=1"})
    assert "access-control-allow-origin" not in other.headers


def test_a_preflight_from_another_origin_is_refused(server):
    response = httpx.options(server.url("/v1/models"), headers={
        "Origin": "http://other.example", "Access-Control-Request-Method": "GET"})
    assert response.status_code == 400
    assert "access-control-allow-origin" not in response.headers


@pytest.mark.parametrize(("key", "status"), [(KEY, 200), (None, 401)])
def test_responses_to_an_allowed_origin_carry_cors_headers(server, key, status):
    headers = {"Origin": ORIGIN, **({"Authorization": f"Bearer {key}"} if key else {})}
    response = httpx.get(server.url("/v1/models"), headers=headers)
    assert response.status_code == status
    assert response.headers["access-control-allow-origin"] == ORIGIN
