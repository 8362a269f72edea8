"""`gateway serve` flags: vLLM's names, their defaults, and the EngineConfig they make."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from gateway.config import CompilationConfig, EngineConfig, SchedulerConfig
from gateway.frontend.cli.args import (
    DEFAULT_MAX_QUEUE_TIME_S,
    engine_config_from_args,
    parse_memory_gib,
)
from tests.frontend.conftest import serve_args, serve_config


def test_defaults_serve_the_default_model_on_loopback():
    args = serve_args()
    assert (args.model, args.host, args.port, args.api_key) == (None, "127.0.0.1", 8000, None)
    # The server refuses a request that waited a minute without starting; the offline
    # engine (SchedulerConfig's default) waits as long as it takes.
    assert engine_config_from_args(args) == EngineConfig(
        scheduler=SchedulerConfig(max_queue_time=DEFAULT_MAX_QUEUE_TIME_S))
    assert EngineConfig().scheduler.max_queue_time is None


@pytest.mark.parametrize(("flags", "max_queue_time"), [
    ([], 60.0), (["--max-queue-time", "2.5"], 2.5), (["--max-queue-time", "0"], None)])
def test_max_queue_time_reaches_the_scheduler(flags, max_queue_time):
    assert engine_config_from_args(serve_args(*flags)).scheduler.max_queue_time == max_queue_time


@pytest.mark.parametrize("flags", [["--max-queue-time", "-1"], ["--shutdown-timeout", "x"],
                                   ["--max-num-queued-reqs", "0"],
                                   ["--engine-stall-threshold", "0"],
                                   ["--event-loop-stall-threshold", "inf"]])
def test_bad_reliability_flags_are_refused(flags):
    with pytest.raises(SystemExit):
        serve_args(*flags)


@pytest.mark.parametrize(("flags", "max_seqs"), [
    ([], 4 * SchedulerConfig().max_num_seqs),  # tied to --max-num-seqs by default
    (["--max-num-seqs", "8"], 32),
    (["--max-num-seqs", "8", "--max-seqs-per-request", "5"], 5)])
def test_max_seqs_per_request_defaults_to_four_batches(flags, max_seqs):
    assert serve_config(*flags).openai.max_seqs_per_request == max_seqs


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_a_bad_max_seqs_per_request_is_refused(value):
    with pytest.raises(SystemExit):
        serve_args("--max-seqs-per-request", value)


def test_engine_flags_fill_the_engine_config():
    config = engine_config_from_args(serve_args(
        "/models/x", "--served-model-name", "x", "--dtype", "half", "--max-model-len", "512",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "1024", "--kv-cache-memory",
        "512MiB", "--block-size", "32", "-tp", "2", "--seed", "7", "--io-processor-plugin",
        "ranker", "--logits-processors", "a.b:C", "d.E", "--logits-processors", "f:G",
        "--disable-log-stats"))
    model = config.model
    assert (model.model, model.served_model_name, model.dtype, model.max_model_len,
            model.seed, model.io_processor_plugin) == ("/models/x", "x", "float16", 512, 7,
                                                       "ranker")
    assert model.logits_processors == ["a.b:C", "d:E", "f:G"]
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (8, 1024)
    assert (config.cache.block_size, config.cache.kv_cache_memory_gib) == (32, 0.5)
    assert config.parallel.tensor_parallel_size == 2
    # --disable-log-stats silences the periodic log line only: the engine still collects
    # stats, which /metrics and plugin stat loggers need.
    assert config.log_stats is True


@pytest.mark.parametrize(("flags", "enabled"), [((), True), (("--enable-prefix-caching",), True),
                                              (("--no-enable-prefix-caching",), False)])
def test_prefix_caching_is_on_unless_turned_off(flags, enabled):
    assert engine_config_from_args(serve_args(*flags)).cache.enable_prefix_caching is enabled


def test_model_may_be_given_as_an_option():
    assert engine_config_from_args(serve_args("--model", "/m")).model.model == "/m"


def test_two_different_models_are_an_error():
    with pytest.raises(ValueError, match="two models"):
        engine_config_from_args(serve_args("/a", "--model", "/b"))


@pytest.mark.parametrize(("text", "gib"), [("1", 1.0), ("1.5", 1.5), ("512MiB", 0.5),
                                           ("2GiB", 2.0), ("1G", 1e9 / 2**30),
                                           ("256 mib", 0.25)])
def test_kv_cache_memory_is_gib_or_a_size_with_a_unit(text, gib):
    assert parse_memory_gib(text) == pytest.approx(gib)


@pytest.mark.parametrize("text", ["0", "-1", "lots", "5XB"])
def test_a_bad_kv_cache_memory_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_memory_gib(text)


@pytest.mark.parametrize(("flags", "gib"), [
    ([], None),
    (["--kv-cache-memory-bytes", "1073741824"], 1.0),
    (["--kv-cache-memory-bytes", "512M"], 0.5),  # vLLM's: an upper-case unit is binary
    (["--kv-cache-memory-bytes", "512MiB"], 0.5),
    (["--kv-cache-memory-bytes", "1g"], 1e9 / 2**30),  # lower case: powers of 1000
    (["--kv-cache-memory-bytes", "2.5g"], 2.5e9 / 2**30),
    (["--kv-cache-memory", "0.5"], 0.5),  # the alias keeps its GiB
    (["--kv-cache-memory", "1G"], 1e9 / 2**30),  # and its units
    (["--kv-cache-memory", "2", "--kv-cache-memory-bytes", "1K"], 1024 / 2**30),  # last wins
])
def test_kv_cache_memory_bytes_and_its_gib_alias_set_one_budget(flags, gib):
    config = engine_config_from_args(serve_args(*flags))
    assert config.cache.kv_cache_memory_gib == (None if gib is None else pytest.approx(gib))


@pytest.mark.parametrize(("flags", "utilization"), [
    ([], 0.9), (["--gpu-memory-utilization", "0.5"], 0.5),
    (["--gpu-memory-utilization", "1"], 1.0)])
def test_gpu_memory_utilization_reaches_the_cache_config(flags, utilization):
    assert engine_config_from_args(serve_args(*flags)).cache.gpu_memory_utilization == \
        utilization


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--gpu-memory-utilization", "0", "expected a number in (0, 1], got '0'"),
    ("--gpu-memory-utilization", "1.5", "expected a number in (0, 1], got '1.5'"),
    ("--gpu-memory-utilization", "-0.2", "expected a number in (0, 1], got '-0.2'"),
    ("--gpu-memory-utilization", "most", "expected a number in (0, 1], got 'most'"),
    ("--kv-cache-memory-bytes", "5XB", "invalid size '5XB'"),
    ("--kv-cache-memory-bytes", "1.5G", "a power-of-1024 unit takes a whole number"),
    ("--kv-cache-memory-bytes", "0", "the size must be positive"),
    ("--kv-cache-memory", "0", "the size must be positive"),
])
def test_bad_memory_flags_stop_gateway_serve_with_one_line_naming_the_flag(flag, value,
                                                                          message):
    result = subprocess.run([sys.executable, "-m", "gateway.frontend.cli.main", "serve",
                             "/no/such/model", flag, value],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    (line,) = [line for line in result.stderr.splitlines() if "error:" in line]
    assert f"argument {flag}: " in line and message in line


@pytest.mark.parametrize("argv", [["--max-num-seqs", "0"], ["--dtype", "int3"],
                                  ["--logits-processors", "NoModule"], ["--port", "x"]])
def test_bad_flags_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit):
        serve_args(*argv)


def test_keep_alive_outlasts_common_clients_idle_expiry_by_default(monkeypatch):
    from gateway.frontend.cli.args import server_config_from_args
    from gateway.frontend.server import _uvicorn_config
    monkeypatch.delenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", raising=False)
    args = serve_args()
    # httpx and the openai SDK drop an idle connection after 5 s, aiohttp after 15 s,
    # nginx and AWS ALB after 60 s: the server must not close it first.
    assert args.timeout_keep_alive > 60
    config = server_config_from_args(args)
    assert _uvicorn_config(object(), config).timeout_keep_alive == args.timeout_keep_alive


def test_keep_alive_comes_from_the_environment_and_the_flag_wins(monkeypatch):
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "30")
    assert serve_args().timeout_keep_alive == 30
    assert serve_args("--timeout-keep-alive", "90").timeout_keep_alive == 90


@pytest.mark.parametrize("raw", ["0", "-5", "soon"])
def test_a_bad_keep_alive_in_the_environment_is_refused(monkeypatch, capsys, raw):
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", raw)
    with pytest.raises(SystemExit):
        serve_args()
    assert "--timeout-keep-alive" in capsys.readouterr().err


def test_an_fp8_kv_cache_is_not_offered_and_its_flag_is_refused(capsys):
    with pytest.raises(SystemExit):
        serve_args("--kv-cache-dtype", "fp8")
    assert "unrecognized arguments: --kv-cache-dtype" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "expected"), [
    ([], CompilationConfig()),
    (["--enforce-eager"], CompilationConfig(enforce_eager=True)),
    (["--max-cudagraph-capture-size", "64"], CompilationConfig(max_cudagraph_capture_size=64)),
    (["--cudagraph-capture-sizes", "8", "1", "4", "4"],
     CompilationConfig(cudagraph_capture_sizes=[1, 4, 8])),
    (["--cudagraph-capture-sizes", "8", "--max-cudagraph-capture-size", "4"],
     CompilationConfig(cudagraph_capture_sizes=[8], max_cudagraph_capture_size=4)),
    # vLLM's older flag: one value caps vLLM's pattern, several are the list
    (["--cuda-graph-sizes", "64"], CompilationConfig(max_cudagraph_capture_size=64)),
    (["--cuda-graph-sizes", "1", "2", "8"], CompilationConfig(cudagraph_capture_sizes=[1, 2, 8])),
])
def test_cuda_graph_flags_reach_the_compilation_config(flags, expected):
    assert engine_config_from_args(serve_args(*flags)).compilation == expected


@pytest.mark.parametrize("argv", [["--max-cudagraph-capture-size", "0"],
                                  ["--cudagraph-capture-sizes", "-8"],
                                  ["--cudagraph-capture-sizes"],
                                  ["--cuda-graph-sizes", "x"]])
def test_bad_cuda_graph_sizes_are_refused_by_the_parser(argv):
    with pytest.raises(SystemExit):
        serve_args(*argv)


def test_the_older_graph_flag_with_the_newer_ones_is_refused():
    with pytest.raises(ValueError, match="--cuda-graph-sizes .* give only the newer flags"):
        engine_config_from_args(serve_args("--cuda-graph-sizes", "8",
                                           "--max-cudagraph-capture-size", "16"))


def test_a_bad_capture_size_stops_gateway_serve_with_one_line_naming_the_flag():
    result = subprocess.run([sys.executable, "-m", "gateway.frontend.cli.main", "serve",
                             "/no/such/model", "--max-cudagraph-capture-size", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    (line,) = [line for line in result.stderr.splitlines() if "error:" in line]
    assert "argument --max-cudagraph-capture-size: expected a positive integer, got 0" in line


def test_speculative_config_takes_vllm_fields_and_defaults():
    from gateway.config import SpeculativeConfig

    config = engine_config_from_args(serve_args(
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 3, "prompt_lookup_min": 2}'))
    assert config.speculative == SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3)
    assert engine_config_from_args(serve_args()).speculative is None
    # vLLM's: neither bound given is 5..5; one given is both.
    only_k = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert (only_k.prompt_lookup_min, only_k.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                            "prompt_lookup_max": 3})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)


@pytest.mark.parametrize(("value", "message"), [
    ("{method: ngram}", "not JSON"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "field 'method': unknown method"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}',
     "unknown field 'lookahead'"),
    ('{"method": "ngram"}', "field 'num_speculative_tokens' is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "field 'num_speculative_tokens'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
     '"prompt_lookup_max": 2}', "field 'prompt_lookup_min' (4) is above"),
    ('{"method": "ngram", "model": "draft.gguf", "num_speculative_tokens": 2}',
     "field 'model': method 'ngram' takes no draft model"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}',
     "field 'model' is required with method 'draft_model'"),
    ('{"model": "draft.gguf"}', "field 'num_speculative_tokens' is required"),
    ('{"model": "draft.gguf", "num_speculative_tokens": 2, "prompt_lookup_max": 3}',
     "field 'prompt_lookup_max' applies to method 'ngram' only"),
    ('{"model": 3, "num_speculative_tokens": 2}', "field 'model' must be a model path"),
])
def test_a_bad_speculative_config_is_refused_naming_the_field(value, message, capsys):
    with pytest.raises(SystemExit):
        serve_args("--speculative-config", value)
    assert f"argument --speculative-config: {message}" in capsys.readouterr().err


def test_a_draft_model_with_ngram_stops_gateway_serve_with_one_line_naming_the_field():
    result = subprocess.run([sys.executable, "-m", "gateway.frontend.cli.main", "serve",
                             "/no/such/model", "--speculative-config",
                             '{"method": "ngram", "model": "draft.gguf", '
                             '"num_speculative_tokens": 3}'],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    (line,) = [line for line in result.stderr.splitlines() if "error:" in line]
    assert ("argument --speculative-config: field 'model': method 'ngram' takes no draft "
            "model") in line


def test_a_draft_model_takes_vllm_fields():
    from gateway.config import SpeculativeConfig

    config = engine_config_from_args(serve_args(
        "--speculative-config", '{"model": "draft.gguf", "num_speculative_tokens": 3}'))
    assert config.speculative == SpeculativeConfig(
        method="draft_model", model="draft.gguf", num_speculative_tokens=3)
    assert config.speculative.uses_draft_model
    assert SpeculativeConfig.from_dict({"method": "draft_model", "model": "d",
                                        "num_speculative_tokens": 2}).model == "d"


def test_a_draft_model_with_tensor_parallelism_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="field 'model': a draft model with "
                                         "--tensor-parallel-size 2 is not supported"):
        engine_config_from_args(serve_args(
            "--tensor-parallel-size", "2", "--speculative-config",
            '{"model": "draft.gguf", "num_speculative_tokens": 3}'))


def test_async_scheduling_with_speculation_is_refused_naming_both_flags():
    with pytest.raises(ValueError, match="--async-scheduling and --speculative-config"):
        engine_config_from_args(serve_args(
            "--async-scheduling", "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3}'))
