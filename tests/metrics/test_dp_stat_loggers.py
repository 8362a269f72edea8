"""With several data-parallel engines the stat-logger manager keeps one set of loggers per
engine (vLLM's way): each batch goes to its engine's loggers only, the Prometheus series
carry `engine`, and the periodic line names each engine."""

from __future__ import annotations

import logging

import msgspec

from gateway.config import ParallelConfig
from gateway.metrics.loggers import LoggingStatLogger
from gateway.metrics.manager import StatLoggerManager
from tests.metrics.helpers import engine_config, exposition, outputs, value


def _dp_manager(num_engines: int) -> StatLoggerManager:
    config = msgspec.structs.replace(
        engine_config(name="served"),
        parallel=ParallelConfig(data_parallel_size=num_engines))
    return StatLoggerManager(config, "served")


def test_each_engines_batches_reach_its_own_loggers_and_series():
    manager = _dp_manager(2)
    for index, generated in ((0, 3), (1, 5), (1, 7)):
        batch = outputs(generated=generated, running=index + 1)
        batch.engine_index = index
        manager.on_outputs(batch)
    text = exposition(manager.registries.exposition)
    assert value(text, "vllm:generation_tokens_total", engine="0") == 3
    assert value(text, "vllm:generation_tokens_total", engine="1") == 12
    assert value(text, "vllm:num_requests_running", engine="1") == 2
    assert [e.engine_index for e in manager.entries if e.name == "prometheus"] == [0, 1]


def test_the_periodic_line_is_logged_once_per_engine(caplog):
    manager = _dp_manager(2)
    batch = outputs(generated=4)
    batch.engine_index = 1
    manager.on_outputs(batch)
    assert all(isinstance(e.logger, LoggingStatLogger) for e in manager.entries
               if e.name == "logging")
    with caplog.at_level(logging.DEBUG, logger="gateway.metrics"):
        manager.log()
    lines = [r.getMessage() for r in caplog.records if "Avg prompt throughput" in r.getMessage()]
    assert [line[:10] for line in lines] == ["Engine 000", "Engine 001"]
    assert "Running: 1 reqs" in lines[1] and "Running: 0 reqs" in lines[0]
