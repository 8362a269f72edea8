"""End to end: the real `gateway serve` (tiny model) scraped by the real Prometheus server;
its /metrics after traffic passes promtool; the stat-logger plugins and `--disable-log-stats`
as an operator meets them."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from gateway.plugins import STAT_LOGGER_PLUGINS_GROUP
from tests.frontend.conftest import SERVED_NAME, tiny_server
from tests.frontend.fake_endpoints import write_fake_endpoints
from tests.metrics.helpers import metrics_text, promtool_problems, samples, value
from tests.metrics.prometheus_server import PrometheusServer
from tests.plugin_dists import write_dist

pytestmark = pytest.mark.e2e

LOG_LINE = "Avg generation throughput"


def complete(client: httpx.Client, max_tokens: int, **extra) -> dict:
    response = client.post("/v1/completions", json={
        "model": SERVED_NAME, "prompt": "Once upon a time", "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, **extra}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def streamed_chat_tokens(client: httpx.Client, max_tokens: int) -> int:
    usage = None
    with client.stream("POST", "/v1/chat/completions", timeout=60, json={
            "model": SERVED_NAME, "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[len("data: "):]).get("usage") or usage
    assert usage is not None
    return int(usage["completion_tokens"])


def wait_until(condition, timeout_s=60.0, interval_s=0.25):
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(interval_s)


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory, usage_records_site):
    """A server with two endpoint plugins (`crashes` fails each request) and the example
    usage-records stat logger writing to a file."""
    folder = tmp_path_factory.mktemp("e2e-metrics")
    site = write_fake_endpoints(folder / "site", ["hello", "crashes"])
    usage = folder / "usage.jsonl"
    server = tiny_server(tiny_llama, roots=(site, usage_records_site),
                         log_path=folder / "server.log",
                         VLLM_PLUGINS="hello,crashes,usage_records",
                         GATEWAY_USAGE_RECORDS_FILE=str(usage))
    with server:
        yield server, usage


def test_metrics_after_traffic_pass_promtool_apart_from_colons(served):
    server, _ = served
    with httpx.Client(base_url=server.url()) as client:
        received = complete(client, 6)["usage"]["completion_tokens"]
        assert client.get("/v1/hello").status_code == 200
        assert client.get("/v1/crash").status_code == 500
        text = metrics_text(client)
    assert promtool_problems(text) == []
    assert value(text, "vllm:generation_tokens_total", model_name=SERVED_NAME,
                 engine="0") >= received
    assert value(text, "gateway_plugin_route_requests_total", plugin="crashes",
                 route="/v1/crash", status="500") == 1
    processes = {dict(labels)["process"] for (name, labels) in samples(text)
                 if name == "gateway_plugin_info"}
    assert "engine-core" in processes  # the engine core's load report reaches /metrics


def test_operators_get_process_http_and_engine_step_metrics(served):
    server, _ = served
    with httpx.Client(base_url=server.url()) as client:
        complete(client, 3)
        assert client.get("/v1/models").status_code == 200
        assert client.get("/no/such/route/42").status_code == 404
        text = metrics_text(client)
    engine_pid = httpx.get(server.url("/v1/plugins")).json()  # any answer: the server is up
    assert engine_pid is not None
    for process in ("api-server", "engine-core"):
        assert value(text, "process_resident_memory_bytes", process=process) > 10e6
        assert value(text, "process_cpu_seconds_total", process=process) > 0
    for process in ("api-server", "engine-core"):  # the engine core's own collector's
        assert value(text, "python_gc_collections_total", generation="0", process=process) > 0
        assert value(text, "python_gc_objects_collected_total", generation="0",
                     process=process) > 0
    assert value(text, "gateway_http_requests_total", route="/v1/models", method="GET",
                 status="200", plugin="") >= 1
    assert value(text, "gateway_http_requests_total", route="/v1/hello", plugin="hello") >= 0
    assert value(text, "gateway_http_requests_total", route="other", status="404") >= 1
    assert not any("/no/such/route" in dict(labels).get("route", "")
                   for (_, labels) in samples(text))  # raw paths never become labels
    assert value(text, "vllm:iteration_tokens_total_count", model_name=SERVED_NAME) >= 3
    assert value(text, "vllm:time_per_output_token_seconds_count", model_name=SERVED_NAME) >= 2
    assert value(text, "vllm:cache_config_info", block_size="16", gpu_memory_utilization="0.9",
                 kv_cache_memory_bytes=str(64 * 2**20)) == 1


def test_the_n_of_each_prompt_is_observed_once_when_its_last_choice_finishes(served):
    server, _ = served

    def histogram(text: str) -> list[float]:
        labels = {"model_name": SERVED_NAME}
        return [value(text, "vllm:request_params_n_count", **labels),
                value(text, "vllm:request_params_n_sum", **labels),
                *(value(text, "vllm:request_params_n_bucket", le=le, **labels)
                  for le in ("1.0", "2.0", "5.0"))]

    with httpx.Client(base_url=server.url()) as client:
        before = histogram(metrics_text(client))
        assert len(complete(client, 2, n=3, temperature=1.0, seed=7)["choices"]) == 3
        complete(client, 2)
        assert len(complete(client, 2, n=2, prompt=["a", "b"])["choices"]) == 4
        # n=3, n=1, then two prompts of n=2: count, sum, and the buckets 1, 2 and 5.
        expected = [b + d for b, d in zip(before, [4, 8, 1, 3, 4])]
        assert wait_until(lambda: histogram(metrics_text(client)) == expected, 10), \
            histogram(metrics_text(client))


def test_usage_records_match_what_the_responses_said(served):
    server, usage = served
    with httpx.Client(base_url=server.url()) as client:
        bodies = [complete(client, n) for n in (2, 5)]

    def records():
        if not usage.exists():
            return None
        found = {r["request_id"]: r for r in map(json.loads, usage.read_text().splitlines())}
        return found if all(b["id"] in found for b in bodies) else None

    found = wait_until(records, timeout_s=10)
    assert found, f"no usage records for {[b['id'] for b in bodies]}"
    for body in bodies:
        record = found[body["id"]]
        assert record["completion_tokens"] == body["usage"]["completion_tokens"]
        assert record["prompt_tokens"] == body["usage"]["prompt_tokens"]
        assert record["model"] == SERVED_NAME and record["finish_reason"] == "length"


def test_a_repeated_prompt_shows_prefix_cache_hits_in_tokens(served):
    server, _ = served
    prompt = "Summarize the following text in one sentence. " * 8
    with httpx.Client(base_url=server.url()) as client:
        def counts() -> tuple[float, float]:
            text = metrics_text(client)
            return (value(text, "vllm:prefix_cache_queries_total", model_name=SERVED_NAME),
                    value(text, "vllm:prefix_cache_hits_total", model_name=SERVED_NAME))

        queries_before, hits_before = counts()
        first = complete(client, 2, prompt=prompt)["usage"]["prompt_tokens"]
        queries_first, hits_first = counts()
        second = complete(client, 2, prompt=prompt)["usage"]["prompt_tokens"]
        queries, hits = counts()
    assert first == second > 32
    assert (queries_first - queries_before, hits_first - hits_before) == (first, 0)
    # The second finds every full block of 16 tokens but the one holding its last token.
    assert (queries - queries_first, hits - hits_first) == (second, (second - 1) // 16 * 16)


def test_the_periodic_log_line_is_written_and_flushed_at_shutdown(served):
    server, _ = served
    with httpx.Client(base_url=server.url()) as client:
        complete(client, 3)
    server.stop()
    assert LOG_LINE in server.log_text() and "Prefix cache hit rate: " in server.log_text()
    assert "Stat loggers: logging (built-in), prometheus (built-in), usage_records (plugin)" \
        in server.log_text()


def test_prometheus_scrapes_the_generation_tokens_the_requests_received(tiny_llama, tmp_path):
    server = tiny_server(tiny_llama, log_path=tmp_path / "server.log")
    prometheus = PrometheusServer([f"127.0.0.1:{server.port}"], tmp_path)
    with server, prometheus:
        assert wait_until(lambda: prometheus.scalar('up{job="gateway"}') == 1.0), \
            "Prometheus never scraped the gateway"
        with httpx.Client(base_url=server.url()) as client:
            received = sum(complete(client, n)["usage"]["completion_tokens"] for n in (3, 7, 11))
            received += streamed_chat_tokens(client, 9)
        query = f'sum(vllm:generation_tokens_total{{model_name="{SERVED_NAME}"}})'
        scraped = wait_until(lambda: prometheus.scalar(query) == received and received)
        assert scraped, (f"Prometheus has {prometheus.scalar(query)} generation tokens; the "
                         f"requests received {received}")
        assert prometheus.scalar(
            f'sum(vllm:request_success_total{{model_name="{SERVED_NAME}",'
            'finished_reason="length"})') == 4


def test_disable_log_stats_drops_the_log_line_but_not_metrics_or_plugin_loggers(
        tiny_llama, tmp_path, usage_records_site):
    usage = tmp_path / "usage.jsonl"
    server = tiny_server(tiny_llama, "--disable-log-stats", roots=(usage_records_site,),
                         log_path=tmp_path / "server.log", GATEWAY_USAGE_RECORDS_FILE=str(usage))
    with server, httpx.Client(base_url=server.url()) as client:
        received = complete(client, 4)["usage"]["completion_tokens"]
        assert wait_until(lambda: value(metrics_text(client),
                                        "vllm:generation_tokens_total") == received)
    assert LOG_LINE not in server.log_text()
    assert len(usage.read_text().splitlines()) == 1


def test_a_stat_logger_plugin_that_is_not_a_subclass_stops_start_up(tiny_llama, tmp_path):
    site = write_dist(tmp_path / "site", "gw-bad-stat-logger", {
        STAT_LOGGER_PLUGINS_GROUP: {"bad_logger": "gw_bad_stat_logger:NotALogger"}},
        {"gw_bad_stat_logger": "class NotALogger:\n    pass\n"})
    server = tiny_server(tiny_llama, roots=(site,), log_path=tmp_path / "server.log")
    try:
        with pytest.raises(RuntimeError, match="exited with"):
            server.start()
    finally:
        server.stop()
    log = server.log_text()
    assert "'bad_logger'" in log and "not a StatLoggerBase subclass" in log
    assert "gw-bad-stat-logger" in log and server.leftover_pids == set()

