"""End to end: `gateway serve --api-server-count 2 --data-parallel-size 2` (tiny model): every
API server connects to both engine cores and balances over them; concurrent requests on new
connections (spread over both API servers) reach both engines with a single engine's greedy
output; /metrics on either API server adds up every engine's counters to what the clients
received; one engine killed mid-stream fails every stream and the supervisor exits, leaving
no process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.executor.test_data_parallel_server import (
    COMPARED,
    ENGINES,
    PROMPTS,
    _complete,
    _series,
    _single_engine_texts,
)
from tests.executor.test_tensor_parallel_server import (
    _alive_after,
    _kill_mid_stream,
    _pids_by_role,
)
from tests.frontend.conftest import tiny_server
from tests.server import ServerProcess, descendant_pids

pytestmark = pytest.mark.e2e

API_SERVERS = ("api-server-0", "api-server-1")


@pytest.fixture(scope="module")
def server(tiny_model: Path, probe_file: Path, probe_site: Path) -> Iterator[ServerProcess]:
    with tiny_server(tiny_model, *COMPARED, "--api-server-count", "2", "--data-parallel-size", "2",
                     roots=(probe_site,), log_path=probe_file.with_suffix(".log"),
                     GATEWAY_TEST_ROLE_PROBE_FILE=str(probe_file)) as server:
        yield server


def _metrics_until(server: ServerProcess, done: Any) -> str:
    """/metrics on new connections until `done(text)` holds six times in a row (so, almost
    surely, on both API servers), or 10 s passed; the last text."""
    agreeing, deadline = 0, time.monotonic() + 10
    while agreeing < 6 and time.monotonic() < deadline:
        text = httpx.get(server.url("/metrics"), timeout=10).text
        agreeing = agreeing + 1 if done(text) else 0
    return text


def _generation_tokens(text: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total{"))


def test_every_process_loads_its_plugins_and_every_report_is_listed(server, probe_file):
    records = httpx.get(server.url("/v1/plugins"), timeout=10).json()["data"]
    seen = {r["process_role"]: r["pid"] for r in records
            if r["name"] == "role_probe" and r["outcome"] == "called"}
    assert sorted(seen) == sorted(["supervisor", *API_SERVERS, *ENGINES])
    probed = _pids_by_role(probe_file)  # the supervisor loads them before it takes its role
    assert sorted(pid for pids in probed.values() for pid in pids) == sorted(seen.values())
    assert all(probed[engine] == [seen[engine]] for engine in ENGINES)
    metrics = httpx.get(server.url("/metrics"), timeout=10).text
    collected = {line.split('process="')[1].split('"')[0] for line in metrics.splitlines()
                 if line.startswith("python_gc_collections_total{")}
    assert set(ENGINES) <= collected  # the engines' gc counts, from the server folder


def test_both_api_servers_balance_over_both_engines_with_a_single_engines_output(
        server, tiny_model):
    before_text = httpx.get(server.url("/metrics"), timeout=10).text
    before = _series(before_text, "vllm:request_success_total")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # a new connection each
        answers = list(pool.map(lambda prompt: _complete(server, prompt), PROMPTS))
    generated = sum(a["usage"]["completion_tokens"] for a in answers)

    def counted(text: str) -> bool:
        finished = _series(text, "vllm:request_success_total")
        served = sum(finished.values()) - sum(before.values())
        tokens = _generation_tokens(text) - _generation_tokens(before_text)
        return served == len(PROMPTS) and tokens == generated

    text = _metrics_until(server, counted)
    assert counted(text), text
    finished = _series(text, "vllm:request_success_total")
    served = {engine: finished[engine] - before.get(engine, 0.0) for engine in finished}
    assert set(served) == {"0", "1"} and min(served.values()) >= 1, served
    assert [a["choices"][0]["text"] for a in answers] == _single_engine_texts(tiny_model,
                                                                               PROMPTS)


def test_a_killed_engine_fails_every_stream_and_ends_the_server(
        server, probe_file):
    # Last in the module: it ends the module's server.
    children = descendant_pids(server.process.pid)
    outcomes: list[dict[str, Any]] = [{} for _ in range(4)]
    roles = _pids_by_role(probe_file)
    # The surviving engine is held while the servers notice, so its streams cannot finish
    # on their own first (a loaded machine's servers took longer than its 2,000 tokens).
    _kill_mid_stream(server, server.url("/v1/completions"), roles["engine-core-dp1"][0],
                     outcomes, 2.0, 30.0, hold=roles["engine-core-dp0"][0])
    assert "The engine core 1 (pid" in server.log_text()
    assert not _alive_after(children, 5.0)
