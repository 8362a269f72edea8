"""The example stat-logger plugin (stat_loggers/usage_records), pip-installed as a user
would, found through its entry point: one JSON line per finished request."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import pytest

from gateway.config import CacheConfig, EngineConfig, ModelConfig
from gateway.frontend.engine_client.client import AsyncEngineClient
from gateway.metrics import StatLoggerManager
from gateway.sampling_params import SamplingParams
from tests.frontend.test_engine_client import LoopThread
from tests.metrics.helpers import engine_config, finished, outputs
from tests.plugin_dists import activate, forget_modules

ENV_VAR = "GATEWAY_USAGE_RECORDS_FILE"


@pytest.fixture
def installed(usage_records_site, monkeypatch):
    activate(usage_records_site, monkeypatch)
    forget_modules("gateway_usage_records")  # import it from the pip-installed copy
    monkeypatch.setenv("VLLM_PLUGINS", "usage_records")
    yield usage_records_site
    forget_modules("gateway_usage_records")


def read_records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_entry_point_loads_it_beside_the_built_ins(installed, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "usage.jsonl"))
    stat_loggers = StatLoggerManager(engine_config(name="billed"), "billed")
    names = [e.name for e in stat_loggers.entries]
    assert names == ["logging", "prometheus", "usage_records"]
    module = sys.modules[type(stat_loggers.loggers[-1]).__module__]
    assert Path(module.__file__).parents[1] == installed  # the pip-installed copy


def test_each_finished_request_is_one_json_line(installed, tmp_path, monkeypatch):
    path = tmp_path / "usage.jsonl"
    monkeypatch.setenv(ENV_VAR, str(path))
    stat_loggers = StatLoggerManager(engine_config(name="billed"), "billed")
    stat_loggers.on_outputs(outputs())  # nothing finished: nothing written
    stat_loggers.on_outputs(outputs(done=(finished("a", "length", 5, 3, e2e=0.5),
                                          finished("b", "abort", 7, 1, e2e=0.25))))
    records = read_records(path)
    assert [r["request_id"] for r in records] == ["a", "b"]
    assert records[0] | {"finished_at": None} == {
        "request_id": "a", "model": "billed", "prompt_tokens": 5, "completion_tokens": 3,
        "total_tokens": 8, "finish_reason": "length", "latency_s": 0.5, "queued_s": 0.1,
        "finished_at": None, "engine": 0}
    assert records[1]["finish_reason"] == "abort" and records[0]["finished_at"].endswith("+00:00")


def test_without_the_variable_it_warns_and_writes_nothing(installed, monkeypatch, caplog):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with caplog.at_level(logging.WARNING, logger="gateway"):
        stat_loggers = StatLoggerManager(engine_config(), "tiny")
    assert any(ENV_VAR in r.getMessage() for r in caplog.records)
    stat_loggers.on_outputs(outputs(done=(finished(),)))  # no error, no file


def test_records_of_a_real_engine_match_the_requests(installed, tiny_llama, tmp_path,
                                                      monkeypatch):
    path = tmp_path / "usage.jsonl"
    monkeypatch.setenv(ENV_VAR, str(path))
    loop = LoopThread()
    config = EngineConfig(model=ModelConfig(model=str(tiny_llama), dtype="float32"),
                          cache=CacheConfig(kv_cache_memory_gib=0.01))
    client = loop.run(AsyncEngineClient.start(config))
    stat_loggers = StatLoggerManager(config, "tiny", client, enable_logging=False)

    async def one(max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids = client.tokenizer.encode("Once upon a time")
        return [o async for o in client.generate(ids, params, f"bill{max_tokens}")][-1]

    async def requests():
        return await asyncio.gather(one(3), one(9))

    try:
        finals = loop.run(requests())
        loop.run(stat_loggers.shutdown())
    finally:
        loop.run(client.shutdown())
        loop.close()
    records = {r["request_id"]: r for r in read_records(path)}
    for final in finals:
        record = records[final.request_id]
        assert record["completion_tokens"] == len(final.token_ids)
        assert record["prompt_tokens"] == len(final.prompt_token_ids)
        assert record["finish_reason"] == "length" and record["model"] == "tiny"
        assert record["latency_s"] > 0
