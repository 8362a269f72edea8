"""End to end: the OpenAI-compatible routes of a real `gateway serve` on the tiny model,
called with the official `openai` SDK and httpx.

One server for the module. The fake endpoint plugins are installed and VLLM_PLUGINS is
unset, so the server also shows the default-deny rule. Client disconnects are in
test_e2e_plugins.py, where the server-info plugin shows the engine's state.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.frontend.conftest import SERVED_NAME, tiny_server

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(tiny_model, fake_endpoints_site, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "openai-server.log"
    with tiny_server(tiny_model, roots=(fake_endpoints_site,), log_path=log) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0,
                         timeout=120)


def _token_id(http, text: str) -> int:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"][0]


def _eos_id(http) -> int:
    return _token_id(http, "<|im_end|>")


# ------------------------------------------------------------------ completions
def test_completion_returns_text_usage_and_finish_reason(client):
    result = client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=5,
                                       extra_body={"ignore_eos": True}, **GREEDY)
    (choice,) = result.choices
    assert isinstance(choice.text, str) and choice.finish_reason == "length"
    assert result.model == SERVED_NAME and result.object == "text_completion"
    usage = result.usage
    assert usage.completion_tokens == 5
    assert usage.total_tokens == usage.prompt_tokens + 5


def test_model_may_be_omitted(http):
    response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert response.status_code == 200


def test_greedy_repeats_and_a_seed_repeats_sampling(client):
    def text(**kwargs):
        return client.completions.create(model=SERVED_NAME, prompt="Once upon a time",
                                         max_tokens=8, extra_body={"ignore_eos": True},
                                         **kwargs).choices[0].text

    assert text(**GREEDY) == text(**GREEDY)
    assert text(temperature=1.0, seed=7) == text(temperature=1.0, seed=7)


def test_prompt_as_token_ids(client, http):
    ids = http.post("/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"]
    result = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=2)
    assert result.usage.prompt_tokens == len(ids)


def test_echo_prefixes_the_prompt(client):
    result = client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=2,
                                       echo=True)
    assert result.choices[0].text.startswith("Hello")


def test_logit_bias_forces_a_token(client, http):
    forced = _token_id(http, "Hello")
    result = client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=4,
                                       logit_bias={str(forced): 100},
                                       extra_body={"ignore_eos": True}, **GREEDY)
    expected = http.post("/detokenize", json={"tokens": [forced] * 4}).json()["prompt"]
    assert result.choices[0].text == expected


def test_stop_token_ids_stop_generation(client, http):
    forced = _token_id(http, "Hello")
    result = client.completions.create(
        model=SERVED_NAME, prompt="x", max_tokens=10, logit_bias={str(forced): 100},
        extra_body={"stop_token_ids": [forced]}, **GREEDY)
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert result.usage.completion_tokens <= 1


def test_stop_string_cuts_the_text(client):
    whole = client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=24,
                                      extra_body={"ignore_eos": True}, **GREEDY)
    text = whole.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop, text
    cut = client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=24,
                                    stop=[stop], extra_body={"ignore_eos": True}, **GREEDY)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_and_ignore_eos_hold_off_a_forced_eos(client, http, ignore_eos):
    eos = _eos_id(http)
    result = client.completions.create(
        model=SERVED_NAME, prompt="x", max_tokens=6, logit_bias={str(eos): 100},
        extra_body={"min_tokens": 3, "ignore_eos": ignore_eos}, **GREEDY)
    choice = result.choices[0]
    if ignore_eos:
        assert (choice.finish_reason, result.usage.completion_tokens) == ("length", 6)
    else:
        assert choice.finish_reason == "stop"
        assert 3 <= result.usage.completion_tokens <= 4


def test_vllm_sampling_extras_and_xargs_are_accepted(client):
    result = client.completions.create(
        model=SERVED_NAME, prompt="Hello", max_tokens=3,
        extra_body={"top_k": 5, "min_p": 0.05, "vllm_xargs": {"note": "anything"}},
        top_p=0.9, temperature=0.8, seed=1)
    assert result.choices[0].finish_reason in ("stop", "length")


# ------------------------------------------------------------------ chat
def test_chat_completion_uses_the_chat_template(client, http):
    messages = [{"role": "user", "content": "Say hi"}]
    result = client.chat.completions.create(model=SERVED_NAME, messages=messages,
                                            max_completion_tokens=4,
                                            extra_body={"ignore_eos": True}, **GREEDY)
    (choice,) = result.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length" and result.object == "chat.completion"
    prompt = http.post("/tokenize", json={"messages": messages}).json()
    assert result.usage.prompt_tokens == prompt["count"]


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(client):
    result = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert result.usage.completion_tokens <= 3


# ------------------------------------------------------------------ streaming
def test_streamed_completion_adds_up_to_the_whole_one(client):
    kwargs = dict(model=SERVED_NAME, prompt="Once upon a time", max_tokens=12,
                  extra_body={"ignore_eos": True}, **GREEDY)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True},
                                            **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_streamed_chat_starts_with_the_role_and_adds_up(client):
    kwargs = dict(model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}],
                  max_completion_tokens=10, extra_body={"ignore_eos": True}, **GREEDY)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_sse_wire_format_ends_with_done(http):
    body = {"prompt": "Hello", "max_tokens": 4, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        assert json.loads(event[len("data: "):])["object"] == "text_completion"


# ------------------------------------------------------------------ errors
def test_n_above_the_servers_maximum_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model=SERVED_NAME, prompt="Hello", n=17)
    assert excinfo.value.body["param"] == "n"


def test_prompt_that_leaves_no_room_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model=SERVED_NAME, prompt=[5] * 2048, max_tokens=1)
    assert excinfo.value.body["code"] == "context_length_exceeded"


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_past_the_context_is_a_400_naming_it(client, param):
    with pytest.raises(openai.BadRequestError) as excinfo:
        if param == "max_tokens":
            client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=5000)
        else:
            client.chat.completions.create(model=SERVED_NAME, max_completion_tokens=5000,
                                           messages=[{"role": "user", "content": "hi"}])
    assert excinfo.value.body["param"] == param
    assert "2048" in excinfo.value.body["message"]


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-served", prompt="Hello")


@pytest.mark.parametrize(("field", "value"), [("logprobs", 21), ("presence_penalty", 2.5),
                                              ("best_of", 3), ("use_beam_search", True)])
def test_unsupported_fields_are_refused_by_name(http, field, value):
    response = http.post("/v1/completions", json={"prompt": "Hello", field: value})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field


def test_bad_sampling_value_is_a_400_naming_it(http):
    response = http.post("/v1/completions", json={"prompt": "Hello", "top_p": 1.5})
    assert (response.status_code, response.json()["error"]["param"]) == (400, "top_p")


# ------------------------------------------------------------------ other routes
def test_models_lists_the_served_name(client):
    (model,) = client.models.list().data
    assert model.id == SERVED_NAME


def test_tokenize_and_detokenize_round_trip(http):
    tokens = http.post("/tokenize", json={"prompt": "Hello, world!"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 2048
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello, world!"


def test_completion_response_carries_the_clients_request_id(http):
    response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1},
                         headers={"X-Request-Id": "trace-123"})
    assert response.headers["x-request-id"] == "trace-123"


def test_unset_allowlist_warns_naming_plugins_and_serves_none(server, http):
    assert http.get("/v1/hello").status_code == 404
    warning = next(line for line in server.log_text().splitlines()
                   if "VLLM_PLUGINS is unset" in line)
    assert "WARNING" in warning and "hello (gw-test-endpoints)" in warning
