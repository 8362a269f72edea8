"""End to end: logprobs through a real server on the tiny model (fp32), against
transformers' log_softmax of the same tokens; OpenAI's shapes for completions and chat,
streamed and not; the lm-eval-harness request (echo, logprobs, max_tokens 0).

The server runs with a small step budget, so a long prompt is prefilled in several
chunks and its prompt logprobs are collected across them.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

from tests.frontend.conftest import SERVED_NAME, tiny_server

pytestmark = pytest.mark.e2e

TOLERANCE = 1e-4
TEXT = "The quick brown fox jumps over the lazy dog. Hello, world!"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "logprobs-server.log"
    with tiny_server(tiny_model, "--dtype", "float32", "--max-num-batched-tokens", "32",
                     log_path=log) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """log_softmax of transformers' logits for a token sequence: [len, vocab]."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def log_softmax(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([token_ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)
    return log_softmax


@pytest.fixture(scope="module")
def prompt_ids(http) -> list[int]:
    ids = http.post("/tokenize", json={"prompt": TEXT * 3}).json()["tokens"]
    assert len(ids) > 40  # more than one prefill chunk of 32
    return ids


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _assert_top(top: dict[str, float], row: torch.Tensor, k: int) -> None:
    expected = row.topk(k)
    for token_id, value in zip(expected.indices.tolist(), expected.values.tolist()):
        assert abs(top[f"token_id:{token_id}"] - value) < TOLERANCE


def test_echo_with_max_tokens_0_scores_the_prompt_as_lm_eval_does(http, prompt_ids,
                                                                   reference):
    response = http.post("/v1/completions", json={
        "prompt": prompt_ids, "echo": True, "logprobs": 3, "max_tokens": 0,
        "return_tokens_as_token_ids": True})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    logprobs = choice["logprobs"]
    assert _ids(logprobs["tokens"]) == prompt_ids
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = reference(prompt_ids)
    for position in range(1, len(prompt_ids)):
        row = expected[position - 1]
        assert abs(logprobs["token_logprobs"][position] - row[prompt_ids[position]]) \
            < TOLERANCE
        _assert_top(logprobs["top_logprobs"][position], row, 3)
    assert response.json()["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_sampled_tokens_logprobs_are_the_raw_distribution(client, prompt_ids, reference,
                                                          stream):
    # temperature and a penalty change the sampling, not the logprobs (vLLM's default).
    result = client.completions.create(
        model=SERVED_NAME, prompt=prompt_ids[:12], max_tokens=6, logprobs=2, seed=7,
        temperature=1.5, stream=stream,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True,
                    "repetition_penalty": 1.3})
    chunks = list(result) if stream else [result]
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    tops = [top for c in chunks for top in c.choices[0].logprobs.top_logprobs]
    generated = _ids(tokens)
    assert len(generated) == 6
    expected = reference(prompt_ids[:12] + generated)
    for step, (token_id, value, top) in enumerate(zip(generated, values, tops)):
        row = expected[11 + step]
        assert abs(value - row[token_id]) < TOLERANCE
        _assert_top(top, row, 2)


def test_text_offsets_follow_the_token_texts(client):
    result = client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=5,
                                       logprobs=0, temperature=0.0, echo=True,
                                       extra_body={"ignore_eos": True})
    logprobs = result.choices[0].logprobs
    lengths = [len(t) for t in logprobs.tokens]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    assert result.choices[0].text.startswith("Hello")


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_have_openai_shape_and_values(client, http, reference, stream):
    messages = [{"role": "user", "content": "Hello, world!"}]
    prompt = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    result = client.chat.completions.create(
        model=SERVED_NAME, messages=messages, max_tokens=5, logprobs=True, top_logprobs=2,
        temperature=0.0, stream=stream,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    chunks = list(result) if stream else [result]
    content = [item for c in chunks for item in (c.choices[0].logprobs.content
                                                 if c.choices and c.choices[0].logprobs
                                                 else [])]
    assert len(content) == 5
    generated = _ids([item.token for item in content])
    expected = reference(prompt + generated)
    for step, item in enumerate(content):
        row = expected[len(prompt) - 1 + step]
        assert abs(item.logprob - row[generated[step]]) < TOLERANCE
        assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 2
        # greedy: the chosen token is the most likely one
        assert item.top_logprobs[0].token == item.token


def test_prompt_logprobs_come_back_in_vllm_shape(http, prompt_ids, reference):
    response = http.post("/v1/completions", json={
        "prompt": prompt_ids, "max_tokens": 1, "prompt_logprobs": 1})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    expected = reference(prompt_ids)
    for position in (1, len(prompt_ids) // 2, len(prompt_ids) - 1):
        actual = entries[position][str(prompt_ids[position])]
        assert abs(actual["logprob"] - expected[position - 1, prompt_ids[position]]) \
            < TOLERANCE
        assert actual["rank"] == int((expected[position - 1]
                                      > expected[position - 1, prompt_ids[position]]).sum()) + 1


def test_no_logprobs_unless_asked(client):
    result = client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=3)
    assert result.choices[0].logprobs is None
    chat = client.chat.completions.create(model=SERVED_NAME, max_tokens=3,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].logprobs is None


@pytest.mark.parametrize(("route", "fields", "param"), [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
])
def test_bad_logprob_requests_are_a_400_naming_the_field(http, route, fields, param):
    body = dict(fields)
    if route.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Hi"}]
    response = http.post(route, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_an_sse_stream_of_echo_scores_the_prompt_once(http, prompt_ids):
    with http.stream("POST", "/v1/completions", json={
            "prompt": prompt_ids, "echo": True, "logprobs": 1, "max_tokens": 0,
            "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == len(prompt_ids)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
