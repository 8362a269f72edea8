"""The built-in logging stat logger: one line per interval."""

from __future__ import annotations

import logging

from gateway.messages import PrefixCacheStats
from gateway.metrics.loggers import CachingMetrics, LoggingStatLogger
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
    assert line.endswith("Prefix cache hit rate: 0.0%")


def test_the_line_gives_the_prefix_cache_hit_rate(caplog):
    stat_logger = LoggingStatLogger(engine_config())
    for hits in (30, 10):
        batch = outputs(prefix_cache=PrefixCacheStats(requests=1, queries=40, hits=hits))
        stat_logger.record(batch.scheduler_stats, batch.iteration_stats)
    with caplog.at_level(logging.INFO, logger="gateway"):
        stat_logger.log()
    assert lines(caplog, logging.INFO)[0].endswith("Prefix cache hit rate: 50.0%")


def test_the_hit_rate_covers_the_most_recent_requests():
    metrics = CachingMetrics(max_recent_requests=4)
    metrics.observe(PrefixCacheStats(requests=2, queries=20, hits=0))
    metrics.observe(PrefixCacheStats(requests=0, queries=0, hits=0))  # nothing looked up
    assert metrics.hit_rate == 0.0
    metrics.observe(PrefixCacheStats(requests=2, queries=20, hits=20))
    assert metrics.hit_rate == 0.5
    metrics.observe(PrefixCacheStats(requests=2, queries=20, hits=10))  # the first drops out
    assert (metrics.num_requests, metrics.hit_rate) == (4, 0.75)


def test_an_idle_engine_logs_once_at_info_then_at_debug(caplog):
    stat_logger = LoggingStatLogger(engine_config())
    batch = outputs(prompt=4, generated=4)
    stat_logger.record(batch.scheduler_stats, batch.iteration_stats)
    with caplog.at_level(logging.DEBUG, logger="gateway"):
        for _ in range(4):
            stat_logger.log()
    assert len(lines(caplog, logging.INFO)) == 2  # the busy interval and the one going idle
    assert len(lines(caplog, logging.DEBUG)) == 2


def test_verified_drafts_add_vllm_s_spec_decoding_line(caplog):
    from gateway.messages import SpecDecodingStats

    stat_logger = LoggingStatLogger(engine_config())
    for accepted in (3, 1):  # two steps, each with two drafts of 3 tokens
        batch = outputs(generated=4)
        assert batch.iteration_stats is not None
        spec = SpecDecodingStats()
        spec.observe(3, accepted)
        spec.observe(3, 0)
        batch.iteration_stats.spec_decoding_stats = spec
        stat_logger.record(batch.scheduler_stats, batch.iteration_stats)
    with caplog.at_level(logging.INFO, logger="gateway"):
        stat_logger.log()
    line = lines(caplog, logging.INFO)[1]
    assert line.startswith("SpecDecoding metrics: Mean acceptance length: 2.00, ")
    assert "Accepted: 4 tokens, Drafted: 12 tokens, Per-position acceptance rate: " \
        "0.500, 0.250, 0.250, Avg Draft acceptance rate: 33.3%" in line
    with caplog.at_level(logging.INFO, logger="gateway"):
        stat_logger.log()  # an interval without drafts: no second line
    assert not [line for line in lines(caplog, logging.INFO)[2:] if "SpecDecoding" in line]
