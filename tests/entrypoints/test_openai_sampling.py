"""From OpenAI request fields to the engine's SamplingParams, and the 400s on the way."""

from __future__ import annotations

import pytest

from gateway.entrypoints.errors import OpenAIError
from gateway.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from gateway.entrypoints.openai.sampling import (
    check_model,
    check_unsupported,
    resolve_max_tokens,
    to_sampling_params,
)

VOCAB = 100


def _params(**fields):
    request = CompletionRequest(prompt="x", **fields)
    check_unsupported(request)
    return to_sampling_params(request, max_tokens=8, vocab_size=VOCAB)


def test_openai_defaults_map_to_the_engine_defaults():
    params = _params()
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, None,
                                                                             0.0)
    assert (params.n, params.max_tokens, params.stop, params.extra_args) == (1, 8, [], None)


def test_every_supported_field_reaches_the_params():
    params = _params(temperature=0.5, top_p=0.9, top_k=-1, min_p=0.1, seed=3, stop="END",
                     stop_token_ids=[4], ignore_eos=True, min_tokens=2,
                     logit_bias={"7": 250.0, "8": -3.0}, extra_args={"a": 1, "b": 1},
                     vllm_xargs={"b": 2})
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.seed) == (
        0.5, 0.9, None, 0.1, 3)
    assert (params.stop, params.stop_token_ids, params.ignore_eos, params.min_tokens) == (
        ["END"], [4], True, 2)
    assert params.logit_bias == {7: 100.0, 8: -3.0}  # clamped to OpenAI's range
    assert params.extra_args == {"a": 1, "b": 2}  # vllm_xargs wins


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 2}, "n"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"100": 1}}, "logit_bias"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop": [""]}, "stop"),
    ({"logprobs": 1}, "logprobs"), ({"best_of": 2}, "best_of"), ({"suffix": "s"}, "suffix"),
    ({"presence_penalty": 1}, "presence_penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_or_unsupported_fields_are_a_400_naming_them(fields, param):
    with pytest.raises(OpenAIError) as excinfo:
        _params(**fields)
    assert (excinfo.value.status, excinfo.value.param) == (400, param)


@pytest.mark.parametrize(("fields", "param"), [
    ({"logprobs": True}, "logprobs"),
])
def test_unsupported_chat_fields_are_a_400(fields, param):
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)
    with pytest.raises(OpenAIError) as excinfo:
        check_unsupported(request)
    assert excinfo.value.param == param


@pytest.mark.parametrize(("requested", "prompt_len", "expected"), [
    (None, 10, 90), (5, 10, 5), (90, 10, 90)])
def test_max_tokens_defaults_to_the_rest_of_the_context(requested, prompt_len, expected):
    assert resolve_max_tokens(requested, prompt_len, 100, "prompt") == expected


@pytest.mark.parametrize(("requested", "prompt_len", "param"), [
    (91, 10, "max_tokens"), (1, 100, "prompt"), (None, 120, "prompt")])
def test_a_request_past_the_context_is_a_400(requested, prompt_len, param):
    with pytest.raises(OpenAIError) as excinfo:
        resolve_max_tokens(requested, prompt_len, 100, "prompt")
    error = excinfo.value
    assert (error.status, error.param, error.code) == (400, param, "context_length_exceeded")
    assert "100" in error.message


def test_model_must_be_the_served_one_when_given():
    check_model(None, "tiny")
    check_model("tiny", "tiny")
    with pytest.raises(OpenAIError) as excinfo:
        check_model("other", "tiny")
    assert (excinfo.value.status, excinfo.value.code) == (404, "model_not_found")
