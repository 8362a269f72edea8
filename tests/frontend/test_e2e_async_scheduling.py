"""--async-scheduling end to end: the tiny random model served twice, with and without the
flag, answers the same requests (concurrent streams, stop strings, max_tokens, n > 1 with a
seed, a JSON schema, preemption in a small KV cache) with the same text through the openai
SDK, and a stream the client drops mid-way leaves the server answering as before."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest

from tests.frontend.conftest import SERVED_NAME, tiny_server

pytestmark = pytest.mark.e2e

# About 24 blocks of 16 tokens: the concurrent batches below preempt. Float32: bfloat16's
# rounding depends on the batch's shape, which the two servers need not share.
_SMALL_KV = ("--dtype", "float32", "--kv-cache-memory", "200k", "--max-num-seqs", "16")


@pytest.fixture(scope="module")
def clients(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    servers = {flag: tiny_server(tiny_model, *_SMALL_KV, *(["--async-scheduling"] if flag
                                                          else []),
                                 log_path=logs / f"async-{flag}.log") for flag in (False, True)}
    try:
        for server in servers.values():  # (from this thread: the server dies with it)
            server.start()
        yield {flag: openai.OpenAI(base_url=server.url("/v1"), api_key="unused",
                                   max_retries=0, timeout=120)
               for flag, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()


def _stream(client: openai.OpenAI, prompt: str, **kwargs) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in client.completions.create(model=SERVED_NAME, prompt=prompt, stream=True,
                                           **kwargs):
        choice = chunk.choices[0]
        text += choice.text
        finish = choice.finish_reason or finish
    return text, finish


def _num_preemptions(client: openai.OpenAI) -> float:
    metrics = httpx.get(str(client.base_url).removesuffix("v1/") + "metrics").text
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("vllm:num_preemptions_total"))


def _on_both(clients, calls: list[tuple[str, dict]]) -> list:
    """Each (prompt, kwargs) streamed concurrently on each server; the results are equal."""
    answers = {}
    for flag, client in clients.items():
        with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
            answers[flag] = list(pool.map(lambda call, c=client: _stream(c, call[0], **call[1]),
                                          calls))
    assert answers[True] == answers[False]
    return answers[True]


def test_concurrent_streams_with_stop_strings_and_max_tokens_match(clients):
    calls = [(f"Request {i} says", {"max_tokens": 30 + 10 * i, "temperature": 0})
             for i in range(10)]
    free = _on_both(clients, calls)  # (an EOS may end one early: on both alike)
    assert [finish for _, finish in free].count("length") >= 5
    # A stop string from the middle of each free answer ends it there, on both servers.
    stopped = _on_both(clients, [(prompt, {**kwargs, "stop": [text[len(text) // 2:][:3]]})
                                 for (prompt, kwargs), (text, _) in zip(calls, free)
                                 if len(text) >= 8])
    assert len(stopped) >= 5 and all(finish == "stop" for _, finish in stopped)
    assert all(_num_preemptions(client) for client in clients.values())


def test_n_with_a_seed_and_a_json_schema_match(clients):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    answers = {}
    for flag, client in clients.items():
        sampled = client.completions.create(model=SERVED_NAME, prompt="Pick", n=3, seed=11,
                                            temperature=1.0, max_tokens=12)
        constrained = client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": "JSON please"}],
            temperature=0, max_tokens=30,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "n", "schema": schema}})
        answers[flag] = ([c.text for c in sampled.choices],
                         constrained.choices[0].message.content)
    assert answers[True] == answers[False]
    assert isinstance(json.loads(answers[True][1])["n"], int)


def test_a_dropped_stream_leaves_the_server_answering_the_same(clients):
    for client in clients.values():
        stream = client.completions.create(model=SERVED_NAME, prompt="Going", stream=True,
                                           max_tokens=200, temperature=0)
        for _, _chunk in zip(range(3), stream):
            pass
        stream.close()
    _on_both(clients, [("After the drop", {"max_tokens": 20, "temperature": 0})] * 3)
