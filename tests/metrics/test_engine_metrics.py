"""Stats from a real engine core (tiny random model) through the engine client's listener
into the stat loggers: counters match what the requests received."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from gateway.frontend.engine_client.client import AsyncEngineClient
from gateway.metrics import StatLoggerManager
from gateway.sampling_params import SamplingParams
from tests.frontend.test_engine_client import LoopThread
from tests.metrics.helpers import exposition, value

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    loop = LoopThread()
    config = EngineConfig(model=ModelConfig(model=str(tiny_llama), dtype="float32",
                                            served_model_name="tiny"),
                          cache=CacheConfig(kv_cache_memory_gib=0.01),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
    client = loop.run(AsyncEngineClient.start(config))
    stat_loggers = StatLoggerManager(config, client.model_name, client)
    yield loop, client, stat_loggers
    loop.run(stat_loggers.shutdown())
    loop.run(client.shutdown())
    loop.close()


def metric(stat_loggers, name, **labels):
    return value(exposition(stat_loggers.registries.exposition), name, model_name="tiny",
                 engine="0", **labels)


def wait_for(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


async def generate(client, prompt, request_id, **params):
    outputs = [o async for o in client.generate(client.tokenizer.encode(prompt),
                                                SamplingParams(**params), request_id)]
    return outputs[-1]


def test_token_counters_equal_what_concurrent_requests_received(engine):
    loop, client, stat_loggers = engine
    before = {name: metric(stat_loggers, name) for name in (
        "vllm:generation_tokens_total", "vllm:prompt_tokens_total",
        "vllm:time_to_first_token_seconds_count")}
    success_before = metric(stat_loggers, "vllm:request_success_total",
                            finished_reason="length")
    prompts = ["Hello", "The quick brown fox", "Once upon a time there was", "0123456789"]

    async def together():
        return await asyncio.gather(*(generate(client, p, f"count{i}", max_tokens=5 + 3 * i,
                                               **GREEDY) for i, p in enumerate(prompts)))

    finals = loop.run(together())
    received = sum(len(f.token_ids) for f in finals)
    prompt_tokens = sum(len(f.prompt_token_ids) for f in finals)
    wait_for(lambda: metric(stat_loggers, "vllm:request_success_total",
                            finished_reason="length") == success_before + 4)
    assert metric(stat_loggers, "vllm:generation_tokens_total") == \
        before["vllm:generation_tokens_total"] + received
    assert metric(stat_loggers, "vllm:prompt_tokens_total") == \
        before["vllm:prompt_tokens_total"] + prompt_tokens
    assert metric(stat_loggers, "vllm:time_to_first_token_seconds_count") == \
        before["vllm:time_to_first_token_seconds_count"] + 4
    wait_for(lambda: metric(stat_loggers, "vllm:num_requests_running") == 0)


def test_a_stop_string_counts_as_stop_and_a_client_that_leaves_as_abort(engine):
    loop, client, stat_loggers = engine
    free_text = loop.run(generate(client, "Hello", "probe", max_tokens=12, **GREEDY)).text
    stop = free_text[len(free_text) // 2:][:3]
    assert stop.strip(), f"the tiny model's text {free_text!r} gives no stop string"
    stops_before = metric(stat_loggers, "vllm:request_success_total", finished_reason="stop")
    final = loop.run(generate(client, "Hello", "stopped", max_tokens=12, stop=[stop], **GREEDY))
    assert final.finish_reason == "stop"
    wait_for(lambda: metric(stat_loggers, "vllm:request_success_total",
                            finished_reason="stop") == stops_before + 1)

    aborts_before = metric(stat_loggers, "vllm:request_success_total", finished_reason="abort")

    async def leave_early():
        stream = client.generate(client.tokenizer.encode("Hello"),
                                 SamplingParams(max_tokens=2000, **GREEDY), "leaver")
        async for _ in stream:
            break
        await stream.aclose()

    loop.run(leave_early())
    wait_for(lambda: metric(stat_loggers, "vllm:request_success_total",
                            finished_reason="abort") == aborts_before + 1)


def test_a_stop_string_on_the_last_allowed_token_counts_as_stop(engine):
    # The engine ends the request by max_tokens on the very token whose text completes the
    # stop string: the client is sent "stop", and the counters must say the same.
    loop, client, stat_loggers = engine

    def stop_on_the_last_token(prompt):
        """The shortest end of the greedy text that the first 11 tokens do not hold."""
        probe = loop.run(generate(client, prompt, f"probe-{prompt}", max_tokens=12, **GREEDY))
        text, text11 = probe.text, client.tokenizer.decode(probe.token_ids[:11])
        return next((text[-n:] for n in range(1, len(text) + 1)
                     if text[-n:].strip() and text[-n:] not in text11), None)

    prompt, stop = next((p, s) for p in ("Once", "Hello", "The sky", "A", "Numbers")
                        if (s := stop_on_the_last_token(p)) is not None)
    before = {reason: metric(stat_loggers, "vllm:request_success_total", finished_reason=reason)
              for reason in ("stop", "length")}
    final = loop.run(generate(client, prompt, "stopped-last", max_tokens=12, stop=[stop],
                              **GREEDY))
    assert (final.finish_reason, len(final.token_ids)) == ("stop", 12)
    wait_for(lambda: metric(stat_loggers, "vllm:request_success_total",
                            finished_reason="stop") == before["stop"] + 1)
    assert metric(stat_loggers, "vllm:request_success_total", finished_reason="length") == \
        before["length"]


def test_loggers_see_the_engines_context_length_and_the_served_name(engine):
    _, client, stat_loggers = engine
    for stat_logger in stat_loggers.loggers:
        assert stat_logger.config.model.max_model_len == client.max_model_len
        assert stat_logger.config.model.served_model_name == "tiny"
