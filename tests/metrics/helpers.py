"""Shared by the metrics tests: stats to feed, and readers of a Prometheus exposition."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import EngineConfig, ModelConfig
from gateway.messages import (
    EngineCoreOutputs,
    FinishedRequestStats,
    IterationStats,
    PrefixCacheStats,
    SchedulerStats,
)

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
COLON_LINT = "metric names should not contain ':'"


def engine_config(name: str = "tiny", max_model_len: int = 512) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model="/models/x", served_model_name=name,
                                          max_model_len=max_model_len))


def finished(request_id: str = "r", reason: str = "length", prompt: int = 5,
             generated: int = 3, e2e: float = 1.0) -> FinishedRequestStats:
    return FinishedRequestStats(request_id, reason, prompt, generated, e2e_latency=e2e,
                                queued_time=0.1, prefill_time=0.2, decode_time=0.6,
                                inference_time=0.9, max_tokens_param=generated)


def outputs(running: int = 1, waiting: int = 2, kv_usage: float = 0.25, prompt: int = 5,
            generated: int = 3, ttfts: tuple[float, ...] = (0.05,),
            itls: tuple[float, ...] = (0.01, 0.02), done: tuple[FinishedRequestStats, ...] = (),
            prefix_cache: PrefixCacheStats | None = None) -> EngineCoreOutputs:
    return EngineCoreOutputs([], 0.0, SchedulerStats(running, waiting, kv_usage, 48, 64,
                                                     prefix_cache_stats=prefix_cache),
                             IterationStats(prompt, generated, list(ttfts), list(itls),
                                            list(done)))


def exposition(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def metrics_text(client: Any) -> str:
    """GET /metrics with an HTTP client (httpx or the test client)."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return str(response.text)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """{(sample name, labels): value} of an exposition."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels: str) -> float:
    """The one sample `name` whose labels include `labels` (the sum if several match)."""
    found = [v for (n, ls), v in samples(text).items()
             if n == name and set(labels.items()) <= ls]
    assert found, f"no sample {name}{labels} in the exposition"
    return sum(found)


#: vLLM's own names that promtool's naming lints flag; dashboards written for vLLM read them
#: by these names (vLLM's `vllm:iteration_tokens_total` is a histogram, not a counter).
VLLM_NAME_LINTS = ('vllm:iteration_tokens_total non-counter metrics should not have "_total" '
                   'suffix',)


def promtool_problems(text: str) -> list[str]:
    """`promtool check metrics` findings, less its lint against ':' in metric names and
    the lints vLLM's own names trip (VLLM_NAME_LINTS)."""
    proc = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60, check=False)
    lines = (proc.stdout + proc.stderr).splitlines()
    problems = [line for line in lines if line.strip() and not line.endswith(COLON_LINT)
                and line.strip() not in VLLM_NAME_LINTS]
    assert proc.returncode in (0, 3), proc.stdout + proc.stderr  # 3: lint findings only
    return problems


def exposed_names(text: str) -> set[str]:
    """Every sample name the exposition has or declares (a labelled metric with no series
    yet still has its # TYPE line): counters give NAME_total, histograms _bucket/_sum/_count."""
    names = {name for name, _ in samples(text)}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count", ""),
                "gauge": ("",), "summary": ("_sum", "_count", "")}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            base = name.removesuffix("_total")
            names.update(base + suffix for suffix in suffixes.get(kind, ("",)))
    return names
