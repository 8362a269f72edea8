"""The built-in Prometheus stat logger: vLLM's names, types and labels, from engine stats."""

from __future__ import annotations

import pytest

from gateway.messages import PrefixCacheStats
from gateway.metrics.prometheus import PrometheusStatLogger, engine_metrics, token_buckets
from gateway.metrics.registry import make_registries
from tests.metrics.helpers import (
    engine_config,
    exposition,
    finished,
    outputs,
    promtool_problems,
    value,
)

REQUIRED = {  # DESIGN section 7 and the issue: name -> Prometheus type
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:prompt_tokens_total": "counter", "vllm:generation_tokens_total": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_success_total": "counter", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
}


def make_logger(name="tiny", engine_index=0):
    registries = make_registries()
    stat_logger = PrometheusStatLogger(engine_config(name), engine_index, registries=registries)
    return stat_logger, registries.exposition


def record(stat_logger, batch):
    stat_logger.record(batch.scheduler_stats, batch.iteration_stats)


def test_the_table_declares_vllms_names_with_their_types():
    declared = {spec.name: spec.kind for spec in engine_metrics(4096)}
    assert {name: declared.get(name) for name in REQUIRED} == REQUIRED
    assert len(declared) == len(engine_metrics(4096))  # no name twice


def test_scheduler_stats_set_the_gauges_labelled_with_model_and_engine():
    stat_logger, registry = make_logger("my-model", engine_index=0)
    record(stat_logger, outputs(running=3, waiting=4, kv_usage=0.5))
    text = exposition(registry)
    labels = {"model_name": "my-model", "engine": "0"}
    assert value(text, "vllm:num_requests_running", **labels) == 3
    assert value(text, "vllm:num_requests_waiting", **labels) == 4
    assert value(text, "vllm:kv_cache_usage_perc", **labels) == 0.5


def test_prefix_cache_lookups_add_up_in_tokens():
    stat_logger, registry = make_logger()
    record(stat_logger, outputs(prefix_cache=PrefixCacheStats(2, 100, 64)))
    record(stat_logger, outputs(prefix_cache=PrefixCacheStats(1, 30, 0)))
    record(stat_logger, outputs(prefix_cache=None))  # caching off: nothing to add
    text = exposition(registry)
    assert value(text, "vllm:prefix_cache_queries_total") == 130
    assert value(text, "vllm:prefix_cache_hits_total") == 64


def test_iteration_stats_add_up_tokens_and_observe_latencies():
    stat_logger, registry = make_logger()
    record(stat_logger, outputs(prompt=5, generated=2, ttfts=(0.05, 0.07), itls=()))
    record(stat_logger, outputs(prompt=0, generated=4, ttfts=(), itls=(0.01,) * 4))
    text = exposition(registry)
    assert value(text, "vllm:prompt_tokens_total") == 5
    assert value(text, "vllm:generation_tokens_total") == 6
    assert value(text, "vllm:time_to_first_token_seconds_count") == 2
    assert value(text, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.12)
    assert value(text, "vllm:inter_token_latency_seconds_count") == 4
    assert value(text, "vllm:inter_token_latency_seconds_bucket", le="0.01") == 4


def test_finished_requests_count_by_reason_and_fill_the_request_histograms():
    stat_logger, registry = make_logger()
    record(stat_logger, outputs(done=(finished("a", "length", e2e=0.4),
                                      finished("b", "stop", e2e=2.0),
                                      finished("c", "stop", e2e=3.0))))
    text = exposition(registry)
    assert value(text, "vllm:request_success_total", finished_reason="stop") == 2
    assert value(text, "vllm:request_success_total", finished_reason="length") == 1
    assert value(text, "vllm:request_success_total", finished_reason="abort") == 0
    assert value(text, "vllm:e2e_request_latency_seconds_count") == 3
    assert value(text, "vllm:e2e_request_latency_seconds_bucket", le="0.5") == 1
    assert value(text, "vllm:request_generation_tokens_count") == 3
    assert value(text, "vllm:request_queue_time_seconds_sum") == pytest.approx(0.3)


def test_every_finish_reason_is_a_series_before_any_request_finished():
    _, registry = make_logger()
    text = exposition(registry)
    for reason in ("stop", "length", "abort", "error"):
        assert value(text, "vllm:request_success_total", finished_reason=reason) == 0


def test_two_apps_in_one_process_keep_their_own_metrics():
    first, first_registry = make_logger("one")
    _, second_registry = make_logger("two")
    record(first, outputs(generated=7))
    assert value(exposition(first_registry), "vllm:generation_tokens_total") == 7
    assert value(exposition(second_registry), "vllm:generation_tokens_total") == 0


def test_token_buckets_are_one_two_five_up_to_the_context_length():
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_buckets(4096)[-1] == 2000


def test_the_exposition_passes_promtool_apart_from_colons_in_names():
    stat_logger, registry = make_logger()
    record(stat_logger, outputs(done=(finished(),)))
    assert promtool_problems(exposition(registry)) == []
