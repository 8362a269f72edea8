"""The built-in logging stat logger: one line per interval."""

from __future__ import annotations

import logging

from gateway.metrics.loggers import LoggingStatLogger
from tests.metrics.helpers import engine_config, outputs


def lines(caplog, level):
    return [r.getMessage() for r in caplog.records
            if r.name == "gateway.metrics" and r.levelno == level]


def test_one_line_gives_throughput_queue_and_kv_usage(caplog):
    stat_logger = LoggingStatLogger(engine_config(), engine_index=0)
    batch = outputs(running=3, waiting=1, kv_usage=0.125, prompt=4000, generated=800)
    stat_logger.record(batch.scheduler_stats, batch.iteration_stats)
    # As if the interval had lasted 200 s: long enough that the real time this test takes,
    # on a loaded machine, cannot move the rounded rates.
    stat_logger.interval_start -= 200.0
    with caplog.at_level(logging.DEBUG, logger="gateway"):
        stat_logger.log()
    (line,) = lines(caplog, logging.INFO)
    assert line.startswith("Engine 000: Avg prompt throughput: 20.0 tokens/s, Avg generation "
                           "throughput: 4.0 tokens/s")
    assert "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 12.5%" in line


def test_an_idle_engine_logs_once_at_info_then_at_debug(caplog):
    stat_logger = LoggingStatLogger(engine_config())
    batch = outputs(prompt=4, generated=4)
    stat_logger.record(batch.scheduler_stats, batch.iteration_stats)
    with caplog.at_level(logging.DEBUG, logger="gateway"):
        for _ in range(4):
            stat_logger.log()
    assert len(lines(caplog, logging.INFO)) == 2  # the busy interval and the one going idle
    assert len(lines(caplog, logging.DEBUG)) == 2
