"""From OpenAI request fields to the engine's SamplingParams, and the 400s on the way."""

from __future__ import annotations

import pytest

from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
from gateway.frontend.openai.sampling import (
    check_model,
    check_unsupported,
    resolve_max_tokens,
    to_sampling_params,
)

VOCAB = 100


class _Tokenizer:
    """Each character is its code point (enough to see what bad_words become)."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


def _params(defaults=None, **fields):
    request = CompletionRequest(prompt="x", **fields)
    check_unsupported(request)
    return to_sampling_params(request, max_tokens=8, vocab_size=VOCAB, tokenizer=_Tokenizer(),
                              defaults=defaults)


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


def test_penalties_masks_and_detokenization_fields_reach_the_params():
    params = _params(presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                     bad_words=["ab"], allowed_token_ids=[1, 2],
                     include_stop_str_in_output=True, skip_special_tokens=False)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.5, -0.5, 1.2)
    assert params.bad_words_token_ids == [[97, 98], [32, 97, 98]]  # alone and after a space
    assert params.allowed_token_ids == [1, 2]
    assert params.include_stop_str_in_output and not params.skip_special_tokens


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, (0.6, 0.9, 20, 1.1)),
    ({"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0},
     (0.0, 1.0, None, 1.0)),
])
def test_the_models_defaults_apply_where_the_request_is_silent(fields, expected):
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    params = _params(defaults, **fields)
    assert (params.temperature, params.top_p, params.top_k,
            params.repetition_penalty) == expected


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 17}, "n"), ({"n": 0}, "n"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"100": 1}}, "logit_bias"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop": [""]}, "stop"),
    ({"logprobs": 21}, "logprobs"), ({"best_of": 2}, "best_of"), ({"suffix": "s"}, "suffix"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"allowed_token_ids": [100]}, "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"use_beam_search": True}, "use_beam_search"), ({"priority": 2**63}, "priority"),
    ({"logits_processors": ["m:C"]}, "logits_processors"),
    ({"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_or_unsupported_fields_are_a_400_naming_them(fields, param):
    with pytest.raises(OpenAIError) as excinfo:
        _params(**fields)
    assert (excinfo.value.status, excinfo.value.param) == (400, param)


@pytest.mark.parametrize(("fields", "param"), [
    ({"top_logprobs": 2}, "top_logprobs"), ({"echo": True}, "echo"),
    ({"modalities": ["text", "audio"]}, "modalities"), ({"store": True}, "store"),
    ({"service_tier": "flex"}, "service_tier"), ({"functions": [{"name": "f"}]}, "functions"),
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
