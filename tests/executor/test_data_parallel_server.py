"""End to end: `gateway serve --data-parallel-size 2` runs two engine cores, each loading
its own plugins; concurrent requests reach both (their `engine` series in /metrics add up
to what the clients received); greedy outputs equal a single engine's (the offline LLM);
and one engine killed mid-stream fails every stream on both engines at once, /health
answers 503 and the server exits, leaving no process.

A probe plugin (a general plugin installed as a real distribution) writes "ROLE PID" for
every process that loads it, which is how the tests know each engine core's pid.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway import LLM
from gateway.sampling_params import SamplingParams
from tests.executor.test_tensor_parallel_server import (
    _alive_after,
    _kill_mid_stream,
    _pids_by_role,
)
from tests.frontend.conftest import tiny_server
from tests.server import ServerProcess, descendant_pids

pytestmark = pytest.mark.e2e

ERROR_WITHIN_S = 2.0
EXIT_WITHIN_S = 15.0
ENGINES = ("engine-core-dp0", "engine-core-dp1")
#: The flags of a server whose answers are compared with `_single_engine_texts`.
COMPARED = ("--dtype", "float32")
PROMPTS = [[1, 17 + i, 40 + 3 * i, 9, 60 - i] for i in range(8)]

@pytest.fixture(scope="module")
def dp_server(tiny_model: Path, probe_file: Path, probe_site: Path) -> Iterator[ServerProcess]:
    server = tiny_server(tiny_model, "--data-parallel-size", "2", *COMPARED, roots=(probe_site,),
                         log_path=probe_file.with_suffix(".log"),
                         GATEWAY_TEST_ROLE_PROBE_FILE=str(probe_file))
    with server:
        yield server


def _complete(server: ServerProcess, prompt: list[int]) -> dict[str, Any]:
    response = httpx.post(server.url("/v1/completions"), timeout=60, json={
        "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return dict(response.json())


def _single_engine_texts(model: Path, prompts: list[list[int]]) -> list[str]:
    """What one in-process engine answers to `prompts`, greedy, as `_complete` asks, in
    float32 as the servers compared with it run (COMPARED): in bfloat16, which "auto" is on
    CPUs with native bf16, the rounding of a batch of other sizes flips near ties of the
    random model."""
    with LLM(str(model), dtype="float32", max_model_len=2048,
             kv_cache_memory_gib=0.0625) as single:
        outputs = single.generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                          ignore_eos=True))
    return [output.text for output in outputs]


def _series(metrics: str, name: str) -> dict[str, float]:
    """{engine label: value} of the `name` series with finished_reason="length"."""
    values = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{") and 'finished_reason="length"' in line:
            engine = line.split('engine="')[1].split('"')[0]
            values[engine] = float(line.rsplit(" ", 1)[1])
    return values


def test_each_engine_core_loads_its_plugins_and_reports_them(dp_server, probe_file):
    records = httpx.get(dp_server.url("/v1/plugins"), timeout=10).json()["data"]
    roles = _pids_by_role(probe_file)
    assert sorted(roles) == ["api-server", *ENGINES]
    assert all(len(pids) == 1 for pids in roles.values())  # once per process
    seen = {(r["process_role"], r["pid"]) for r in records
            if r["name"] == "role_probe" and r["outcome"] == "called"}
    assert seen == {(role, pids[0]) for role, pids in roles.items()}
    metrics = httpx.get(dp_server.url("/metrics"), timeout=10).text
    memory = {line.split('"')[1] for line in metrics.splitlines()
              if line.startswith("process_resident_memory_bytes{")}
    assert memory == {"api-server", *ENGINES}
    collected = {line.split('process="')[1].split('"')[0] for line in metrics.splitlines()
                 if line.startswith("python_gc_collections_total{")}
    assert collected == {"api-server", *ENGINES}  # each engine's own gc counts


def test_concurrent_requests_reach_both_engines_with_a_single_engines_greedy_output(
        dp_server, tiny_model):
    before = _series(httpx.get(dp_server.url("/metrics"), timeout=10).text,
                     "vllm:request_success_total")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda prompt: _complete(dp_server, prompt), PROMPTS))
    metrics = httpx.get(dp_server.url("/metrics"), timeout=10).text
    finished = _series(metrics, "vllm:request_success_total")
    served = {engine: finished[engine] - before.get(engine, 0.0) for engine in finished}
    assert set(served) == {"0", "1"} and min(served.values()) >= 1, served
    assert sum(served.values()) == len(PROMPTS)
    tokens = {line.split('engine="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
              for line in metrics.splitlines()
              if line.startswith("vllm:generation_tokens_total{")}
    assert set(tokens) == {"0", "1"} and all(value > 0 for value in tokens.values())
    assert [a["choices"][0]["text"] for a in answers] == _single_engine_texts(tiny_model,
                                                                               PROMPTS)
    assert all(a["usage"]["completion_tokens"] == 12 for a in answers)


def test_a_killed_engine_fails_every_engines_streams_and_ends_the_server(
        dp_server, probe_file):
    # Last in the module: it ends the module's server.
    children = descendant_pids(dp_server.process.pid)
    outcomes: list[dict[str, Any]] = [{} for _ in range(4)]
    roles = _pids_by_role(probe_file)
    _kill_mid_stream(dp_server, dp_server.url("/v1/completions"), roles["engine-core-dp1"][0],
                     outcomes, ERROR_WITHIN_S, EXIT_WITHIN_S, hold=roles["engine-core-dp0"][0])
    assert "data-parallel engine 1: the engine core" in dp_server.log_text()
    assert not _alive_after(children, 5.0)
