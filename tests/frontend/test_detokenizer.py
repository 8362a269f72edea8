"""Incremental detokenization and stop strings, with a real byte-level BPE tokenizer."""

from __future__ import annotations

import pytest

from gateway.frontend.outputs.output_processor import RequestState
from gateway.messages import EngineCoreOutput
from gateway.sampling_params import SamplingParams
from gateway.tokenizer import load_tokenizer

TEXTS = ["Hello, world! This is a tiny model.", "naïve café — 東京 🚀🎉 done",
         "Plugins extend the gateway."]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(tiny_llama)


def stream(tokenizer, text, **params):
    """Feed `text`'s tokens one by one; return (outputs, state)."""
    prompt = tokenizer.encode("Once upon a time")
    ids = tokenizer.encode(text, add_special_tokens=False)
    state = RequestState.make("r", prompt, SamplingParams(**params), tokenizer)
    outputs = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        out = state.process(EngineCoreOutput("r", [token], "length" if last else None))
        outputs.append(out)
        if out.finished:
            break
    return outputs, ids


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_add_up_to_the_full_decode(tokenizer, text):
    outputs, ids = stream(tokenizer, text)
    assert "".join(o.delta_text for o in outputs) == tokenizer.decode(ids) == outputs[-1].text
    assert all("\ufffd" not in o.delta_text for o in outputs)  # multi-byte chars whole


def test_multibyte_characters_split_across_tokens_are_held_until_complete(tokenizer):
    ids = tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's bytes are several tokens in this tiny vocabulary
    outputs, _ = stream(tokenizer, "🚀")
    assert [o.delta_text for o in outputs if o.delta_text] == ["🚀"]


def test_stop_string_split_across_tokens_is_found_and_never_output(tokenizer):
    text = "Hello, world! This is a tiny model."
    stop = "is a t"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert stop not in pieces  # genuinely split across tokens
    outputs, _ = stream(tokenizer, text, stop=[stop])
    final = outputs[-1]
    assert final.finished and final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == "Hello, world! This "
    streamed = "".join(o.delta_text for o in outputs)
    assert streamed == final.text and "is a" not in streamed


def test_text_that_only_starts_a_stop_string_is_released_at_the_end(tokenizer):
    outputs, _ = stream(tokenizer, "Hello, world", stop=["world!"])
    assert outputs[-1].finish_reason == "length"
    assert "".join(o.delta_text for o in outputs) == "Hello, world"


def test_stop_token_text_is_not_output(tokenizer):
    prompt = tokenizer.encode("Hi")
    state = RequestState.make("r", prompt, SamplingParams(), tokenizer)
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    state.process(EngineCoreOutput("r", hello, None))
    out = state.process(EngineCoreOutput("r", [tokenizer.encode("!", add_special_tokens=False)[0]],
                                         "stop", stop_reason=5))
    assert out.text == "Hello" and out.stop_reason == 5 and len(out.token_ids) == len(hello) + 1


def test_tokens_after_a_stop_string_in_one_output_are_dropped(tokenizer):
    """Speculative decoding sends several tokens at once: a stop string among them ends
    the output with the same text and tokens as one token at a time."""
    text = "Hello, world! This is a tiny model."
    stop = "is a t"
    one_by_one, ids = stream(tokenizer, text, stop=[stop])
    state = RequestState.make("r", tokenizer.encode("Once upon a time"),
                              SamplingParams(stop=[stop]), tokenizer)
    first = state.process(EngineCoreOutput("r", ids[:2], None))
    final = state.process(EngineCoreOutput("r", ids[2:], None))  # all the rest at once
    assert final.finished and final.stop_reason == stop
    assert final.text == one_by_one[-1].text
    assert final.token_ids == one_by_one[-1].token_ids
    assert first.delta_token_ids + final.delta_token_ids == final.token_ids
