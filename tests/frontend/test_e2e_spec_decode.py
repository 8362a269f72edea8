"""End to end: speculative decoding with n-gram drafts and with a draft model on real
servers (tiny model).

A server with --speculative-config. A greedy request with logprobs runs without drafts
(logprobs are not built for them), so it gives the tokens a server without speculation
gives: the same request without logprobs, which verifies drafts, must match them. The
spec-decoding counters then show in /metrics. A draft model of another vocabulary or
tokenizer stops start-up with one line naming the field.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import httpx
import pytest

from tests.frontend.conftest import TINY_FLAGS, tiny_server
from tests.server import free_port

pytestmark = pytest.mark.e2e

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def http(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec")
    with tiny_server(tiny_model, "--dtype", "float32", "--speculative-config",
                     json.dumps(SPEC), log_path=folder / "server.log") as server, \
            httpx.Client(base_url=server.url(), timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def draft_http(tiny_model, tmp_path_factory):
    """A server whose draft model is the target itself: every draft is accepted."""
    folder = tmp_path_factory.mktemp("draft")
    config = {"model": str(tiny_model), "num_speculative_tokens": 4}
    with tiny_server(tiny_model, "--dtype", "float32", "--speculative-config",
                     json.dumps(config), log_path=folder / "server.log") as server, \
            httpx.Client(base_url=server.url(), timeout=120) as client:
        yield client


def _completion(http, prompt, **fields):
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **fields}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_greedy_output_with_drafts_equals_the_output_without(http):
    rng = random.Random(0)
    passage = [rng.randrange(3, 430) for _ in range(12)]
    for prompt in (passage * 4, [rng.randrange(3, 430) for _ in range(30)]):
        with_drafts = _completion(http, prompt)
        without = _completion(http, prompt, logprobs=0)
        assert with_drafts["token_ids"] == without["token_ids"]
        assert with_drafts["text"] == without["text"]
        # A stop string met inside accepted drafts ends the text where it would.
        stop = without["text"][len(without["text"]) * 3 // 4:][:3]
        if stop.strip():
            assert (_completion(http, prompt, stop=[stop])["text"]
                    == _completion(http, prompt, stop=[stop], logprobs=0)["text"])


def test_spec_decoding_counters_show_in_metrics(http):
    _completion(http, [5, 6, 7, 8] * 10)
    text = http.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = values.get(name.split("{")[0], 0.0) + float(value)
    assert values["vllm:spec_decode_num_drafts_total"] > 0
    assert values["vllm:spec_decode_num_draft_tokens_total"] > 0
    assert 0 < values["vllm:spec_decode_num_accepted_tokens_total"] \
        == values["vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert 'position="0"' in text


def _spec_counters(http) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("vllm:spec_decode_"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = values.get(name.split("{")[0], 0.0) + float(value)
    return values


def test_greedy_output_with_a_draft_model_equals_the_output_without(draft_http):
    rng = random.Random(1)
    for prompt in ([rng.randrange(3, 430) for _ in range(30)], "Once upon a time"):
        without = _completion(draft_http, prompt, logprobs=0)
        with_drafts = _completion(draft_http, prompt)
        assert with_drafts["token_ids"] == without["token_ids"]
        assert with_drafts["text"] == without["text"]
    body = {"prompt": "The quick brown", "max_tokens": 24, "temperature": 0.0, "n": 2,
            "ignore_eos": True}
    response = draft_http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    texts = [choice["text"] for choice in response.json()["choices"]]
    assert texts == [_completion(draft_http, "The quick brown", max_tokens=24,
                                 logprobs=0)["text"]] * 2
    values = _spec_counters(draft_http)
    assert values["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 < values["vllm:spec_decode_num_accepted_tokens_total"] \
        == values["vllm:spec_decode_num_draft_tokens_total"] \
        == values["vllm:spec_decode_num_accepted_tokens_per_pos_total"]


def _other_tokenizer(model, folder):
    """A copy of `model` whose tokenizer gives two tokens each other's ids."""
    copy = shutil.copytree(model, folder / "swapped")
    tokenizer = json.loads((copy / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (copy / "tokenizer.json").write_text(json.dumps(tokenizer))
    return copy


@pytest.mark.parametrize("draft", ["vocabulary", "tokenizer"])
def test_a_draft_model_of_another_vocabulary_stops_start_up_with_one_line(
        tiny_model, tmp_path, draft):
    from tests.tiny_model import build_tiny_llama

    path = (build_tiny_llama(tmp_path / "small", vocab_size=300) if draft == "vocabulary"
            else _other_tokenizer(tiny_model, tmp_path))
    config = json.dumps({"model": str(path), "num_speculative_tokens": 3})
    process = subprocess.run(
        [sys.executable, "-m", "gateway.frontend.cli.main", "serve", str(tiny_model),
         *TINY_FLAGS, "--port", str(free_port()), "--speculative-config", config],
        capture_output=True, text=True, timeout=120)
    output = process.stdout + process.stderr
    lines = [line for line in output.splitlines() if "Cannot start:" in line]
    assert process.returncode == 1, output
    assert len(lines) == 1 and "Traceback" not in output, output
    assert f"--speculative-config: field 'model': the draft model's {draft}" in lines[0]
