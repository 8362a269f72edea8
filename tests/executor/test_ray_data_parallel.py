"""End to end on a real local Ray cluster (`ray start --head`, loopback): `gateway serve -dp 2
--data-parallel-backend ray` places its two engine cores as Ray actors, not children of the
server; each loads the general plugins itself (their records reach /v1/plugins with the
actor's role and pid); concurrent requests reach both, with a single engine's greedy
output; and an engine actor killed mid-stream ends every stream with an error within a few
seconds, the server exits, and no actor is left running.

The engine actors reach the server's ZMQ sockets over TCP on loopback
(--data-parallel-address 127.0.0.1). The cluster is the executor tests' (conftest.py's
`ray_address`, one for the package).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.executor.test_data_parallel_server import (
    COMPARED,
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
from tests.server import ServerProcess, descendant_pids, is_alive

pytestmark = pytest.mark.e2e

ERROR_WITHIN_S = 5.0
EXIT_WITHIN_S = 20.0
ENGINES = ("engine-core-dp0", "engine-core-dp1")
PROMPTS = [[1, 17 + i, 40 + 3 * i, 9, 60 - i] for i in range(6)]

def _server(model: Path, site: Path, ray_address: str, probe: Path,
            *flags: str) -> ServerProcess:
    return tiny_server(model, *COMPARED, "-dp", "2", "-dpb", "ray", "--data-parallel-address",
                       "127.0.0.1", *flags, roots=(site,), log_path=probe.with_suffix(".log"),
                       RAY_ADDRESS=ray_address, GATEWAY_TEST_ROLE_PROBE_FILE=str(probe),
                       RAY_USAGE_STATS_ENABLED="0")


@pytest.fixture(scope="module")
def dp_ray_server(tiny_model: Path, ray_address: str, probe_file: Path,
                  probe_site: Path) -> Iterator[ServerProcess]:
    with _server(tiny_model, probe_site, ray_address, probe_file) as server:
        yield server


def test_engine_actors_load_their_plugins_and_report_them(dp_ray_server, probe_file):
    records = httpx.get(dp_ray_server.url("/v1/plugins"), timeout=10).json()["data"]
    roles = _pids_by_role(probe_file)
    assert sorted(roles) == ["api-server", *ENGINES]
    assert all(len(pids) == 1 for pids in roles.values())  # once per process
    seen = {(r["process_role"], r["pid"]) for r in records
            if r["name"] == "role_probe" and r["outcome"] == "called"}
    assert seen == {(role, pids[0]) for role, pids in roles.items()}
    # Placed by Ray (children of its raylet), not spawned by the server.
    engine_pids = {roles[role][0] for role in ENGINES}
    assert not engine_pids & descendant_pids(dp_ray_server.process.pid)
    # Actors on the server's host: their process and gc series, as for local engines.
    metrics = httpx.get(dp_ray_server.url("/metrics"), timeout=10).text
    for series in ("process_resident_memory_bytes{", "python_gc_collections_total{"):
        labelled = {line.split('process="')[1].split('"')[0] for line in metrics.splitlines()
                    if line.startswith(series)}
        assert labelled == {"api-server", *ENGINES}, series
    log = dp_ray_server.log_text()
    assert "(EngineCoreActor pid=" in log
    assert "reaching this front end at 127.0.0.1." in log  # the engines' TCP: loopback


def test_concurrent_requests_reach_both_engine_actors_with_a_single_engines_greedy_output(
        dp_ray_server, tiny_model):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda prompt: _complete(dp_ray_server, prompt), PROMPTS))
    finished = _series(httpx.get(dp_ray_server.url("/metrics"), timeout=10).text,
                       "vllm:request_success_total")
    assert set(finished) == {"0", "1"} and min(finished.values()) >= 1, finished
    assert sum(finished.values()) == len(PROMPTS)
    assert [a["choices"][0]["text"] for a in answers] == _single_engine_texts(tiny_model,
                                                                               PROMPTS)


def test_a_killed_engine_actor_fails_the_streams_and_leaves_nothing_running(
        dp_ray_server, probe_file):
    # Last in the module: it ends the module's server.
    roles = _pids_by_role(probe_file)
    actors = {roles[role][0] for role in ENGINES}
    outcomes: list[dict[str, Any]] = [{} for _ in range(4)]
    _kill_mid_stream(dp_ray_server, dp_ray_server.url("/v1/completions"),
                     roles["engine-core-dp1"][0], outcomes, ERROR_WITHIN_S, EXIT_WITHIN_S)
    log = dp_ray_server.log_text()
    assert "Ray actor of data-parallel engine 1" in log
    assert "data-parallel engine 1: the engine core" in log
    assert not _alive_after(actors, 10.0), [pid for pid in actors if is_alive(pid)]


def test_two_api_servers_share_the_engine_actors_and_a_killed_one_ends_the_server(
        tiny_model, ray_address, probe_site, tmp_path):
    # After the module's server is gone (its actors freed the cluster's two CPUs).
    probe = tmp_path / "probe.txt"
    with _server(tiny_model, probe_site, ray_address, probe, "--api-server-count", "2") as server:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            list(pool.map(lambda prompt: _complete(server, prompt), PROMPTS))
        finished = _series(httpx.get(server.url("/metrics"), timeout=10).text,
                           "vllm:request_success_total")
        assert set(finished) == {"0", "1"} and sum(finished.values()) == len(PROMPTS)
        records = httpx.get(server.url("/v1/plugins"), timeout=10).json()["data"]
        roles = _pids_by_role(probe)
        seen = {(r["process_role"], r["pid"]) for r in records
                if r["name"] == "role_probe" and r["outcome"] == "called"}
        assert {(role, roles[role][0]) for role in ENGINES} <= seen
        actors = {roles[role][0] for role in ENGINES}
        outcomes: list[dict[str, Any]] = [{} for _ in range(4)]
        _kill_mid_stream(server, server.url("/v1/completions"), roles["engine-core-dp0"][0],
                         outcomes, ERROR_WITHIN_S, EXIT_WITHIN_S)
        assert "Ray actor of data-parallel engine 0" in server.log_text()
        assert not _alive_after(actors, 10.0), [pid for pid in actors if is_alive(pid)]
