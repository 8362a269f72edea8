"""End to end: penalties, token masks and detokenization fields, `n` choices and batched
prompts, through a real server on the tiny model (fp32) with the openai SDK; penalised
greedy outputs against transformers' model with the same penalties."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from tests.frontend.conftest import SERVED_NAME, tiny_server

pytestmark = pytest.mark.e2e

NUM_TOKENS = 8
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "sampling-server.log"
    with tiny_server(tiny_model, "--dtype", "float32", log_path=log) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def prompt_ids(http) -> list[int]:
    return http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]


def _complete(client, prompt, **fields):
    extra = {"ignore_eos": True, **fields.pop("extra_body", {})}
    return client.completions.create(model=SERVED_NAME, prompt=prompt,
                                     max_tokens=fields.pop("max_tokens", NUM_TOKENS),
                                     temperature=fields.pop("temperature", 0.0),
                                     extra_body=extra, **fields)


def _generated_ids(client, prompt_ids, **fields) -> list[int]:
    result = _complete(client, prompt_ids, extra_body={"return_token_ids": True, **fields})
    return result.choices[0].model_extra["token_ids"]


# ------------------------------------------------------------------ penalties
@pytest.fixture(scope="module")
def transformers_greedy(tiny_model):
    """Greedy decoding with transformers' model: repetition penalty by transformers'
    RepetitionPenaltyLogitsProcessor, presence and frequency by OpenAI's definition."""
    from transformers import LlamaForCausalLM, RepetitionPenaltyLogitsProcessor

    model = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def generate(prompt: list[int], repetition=1.0, presence=0.0, frequency=0.0):
        ids = list(prompt)
        for _ in range(NUM_TOKENS):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[:, -1].float()
            if repetition != 1.0:
                logits = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([ids]),
                                                                      logits)
            counts = torch.bincount(torch.tensor(ids[len(prompt):], dtype=torch.long),
                                    minlength=logits.shape[-1])[:logits.shape[-1]].float()
            logits = logits - frequency * counts - presence * (counts > 0).float()
            ids.append(int(logits.argmax(-1)))
        return ids[len(prompt):]
    return generate


@pytest.mark.parametrize("penalties", [
    {"repetition_penalty": 1.8},
    {"repetition_penalty": 0.7},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 1.2},
    {"presence_penalty": 0.8, "frequency_penalty": 0.6, "repetition_penalty": 1.3},
])
def test_penalised_greedy_output_equals_transformers(client, prompt_ids,
                                                     transformers_greedy, penalties):
    expected = transformers_greedy(prompt_ids, penalties.get("repetition_penalty", 1.0),
                                   penalties.get("presence_penalty", 0.0),
                                   penalties.get("frequency_penalty", 0.0))
    assert _generated_ids(client, prompt_ids, **penalties) == expected
    assert expected != transformers_greedy(prompt_ids)  # the penalty changed the output


def test_penalties_apply_per_row_in_one_batch(client, prompt_ids, transformers_greedy):
    """Penalised and plain requests in flight together keep their own outputs."""
    import concurrent.futures

    cases = [{}, {"repetition_penalty": 1.8}, {"frequency_penalty": 1.2}, {}]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        outputs = list(pool.map(lambda c: _generated_ids(client, prompt_ids, **c), cases))
    assert outputs[0] == outputs[3] == transformers_greedy(prompt_ids)
    assert outputs[1] == transformers_greedy(prompt_ids, repetition=1.8)
    assert outputs[2] == transformers_greedy(prompt_ids, frequency=1.2)


# ------------------------------------------------------------------ masks
def test_allowed_token_ids_limit_the_output(client, prompt_ids):
    allowed = [40, 41, 42]
    assert set(_generated_ids(client, prompt_ids, allowed_token_ids=allowed)) <= set(allowed)


def test_bad_words_are_never_generated(client, http, prompt_ids):
    plain = _generated_ids(client, prompt_ids)
    word = _detokenize(http, [plain[0]])
    banned = _generated_ids(client, prompt_ids, bad_words=[word])
    assert plain[0] != banned[0]
    assert word.strip() not in [_detokenize(http, [t]).strip() for t in banned]


def _detokenize(http, ids):
    return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]


# ------------------------------------------------------------------ detokenization
def test_include_stop_str_in_output_keeps_the_stop_string(client, prompt_ids):
    text = _complete(client, prompt_ids, max_tokens=12).choices[0].text
    stop = text[3:6]
    assert stop and len(text) > 6
    cut = _complete(client, prompt_ids, max_tokens=12, stop=[stop]).choices[0]
    kept = _complete(client, prompt_ids, max_tokens=12, stop=[stop],
                     extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.text == cut.text + stop
    assert cut.finish_reason == kept.finish_reason == "stop"


def test_skip_special_tokens_false_shows_them(client, http):
    eos = http.post("/tokenize", json={"prompt": "<|im_end|>"}).json()["tokens"]
    kept = _complete(client, [5, 6], max_tokens=3,
                     extra_body={"allowed_token_ids": eos, "skip_special_tokens": False})
    skipped = _complete(client, [5, 6], max_tokens=3, extra_body={"allowed_token_ids": eos})
    assert kept.choices[0].text == "<|im_end|>" * 3
    assert skipped.choices[0].text == ""


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, prompt_ids):
    truncated = _complete(client, prompt_ids, extra_body={"truncate_prompt_tokens": 5})
    tail = _complete(client, prompt_ids[-5:])
    assert truncated.usage.prompt_tokens == 5
    assert truncated.choices[0].text == tail.choices[0].text


# ------------------------------------------------------------------ n and batches
def test_n_seeded_samples_are_reproducible_and_differ(client, prompt_ids):
    first = _complete(client, prompt_ids, n=3, seed=11, temperature=1.0)
    again = _complete(client, prompt_ids, n=3, seed=11, temperature=1.0)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) == 3
    assert all(c.finish_reason == "length" for c in first.choices)
    assert first.usage.completion_tokens == 3 * NUM_TOKENS
    assert first.usage.prompt_tokens == len(prompt_ids)


def test_streamed_n_choices_interleave_by_index_and_equal_the_whole(client, prompt_ids):
    whole = _complete(client, prompt_ids, n=2, seed=5, temperature=1.0)
    texts, finishes = ["", ""], [None, None]
    for chunk in _complete(client, prompt_ids, n=2, seed=5, temperature=1.0, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [c.text for c in whole.choices]
    assert finishes == ["length", "length"]


def test_chat_n_gives_n_choices(client):
    result = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Hello"}], n=2, seed=3,
        max_tokens=NUM_TOKENS, extra_body={"ignore_eos": True})
    assert [c.index for c in result.choices] == [0, 1]
    assert result.choices[0].message.content != result.choices[1].message.content
    assert result.usage.completion_tokens == 2 * NUM_TOKENS


@pytest.mark.parametrize("as_ids", [False, True])
def test_a_batch_of_prompts_equals_the_prompts_one_by_one(client, http, as_ids):
    prompts = ["Hello, world!", "Once upon a time", "The quick brown fox"]
    if as_ids:
        prompts = [http.post("/tokenize", json={"prompt": p}).json()["tokens"]
                   for p in prompts]
    batch = _complete(client, prompts, n=2, seed=1, temperature=1.0)
    singles = [_complete(client, p, n=2, seed=1, temperature=1.0) for p in prompts]
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [c.text for s in singles for c in s.choices]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_a_streamed_batch_names_each_choice(http):
    body = {"prompt": ["Hello", "Once upon"], "max_tokens": 3, "stream": True,
            "ignore_eos": True, "temperature": 0.0}
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    finished = sorted(c["index"] for e in events for c in e["choices"] if c["finish_reason"])
    assert finished == [0, 1]
