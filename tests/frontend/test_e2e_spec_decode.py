"""End to end: speculative decoding with n-gram drafts on a real server (tiny model).

One server with --speculative-config. A greedy request with logprobs runs without drafts
(logprobs are not built for them), so it gives the tokens a server without speculation
gives: the same request without logprobs, which verifies drafts, must match them. The
spec-decoding counters then show in /metrics.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest

from tests.frontend.conftest import tiny_server

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
