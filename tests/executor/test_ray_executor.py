"""End to end on a real local Ray cluster (`ray start --head`, loopback): `gateway serve -tp 2
--distributed-executor-backend ray` places its ranks as Ray actors, each loading the general
plugins itself (their records reach /v1/plugins); greedy output equals one rank's (the
offline LLM, -tp 1); and an actor killed mid-stream ends every stream with an error within
a few seconds, the server exits, and no actor is left running.

The probe plugin's variable is named GATEWAY_*: the executor forwards the VLLM_*, GATEWAY_*
and HF_* variables (and PYTHONPATH) to the actors, and a plugin's own settings reach them
that way.

The cluster is the executor tests' (tests/executor/ray_head.py), shared with the
data-parallel Ray tests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.executor.test_data_parallel_server import COMPARED, _single_engine_texts
from tests.executor.test_tensor_parallel_server import (
    _alive_after,
    _kill_mid_stream,
    _pids_by_role,
)
from tests.frontend.conftest import tiny_server
from tests.server import ServerProcess, is_alive

pytestmark = pytest.mark.e2e

ERROR_WITHIN_S = 5.0
EXIT_WITHIN_S = 20.0
PROMPT = [1, 5, 9, 33, 70, 12]

@pytest.fixture(scope="module")
def ray_server(tiny_model: Path, ray_address: str, probe_file: Path,
               probe_site: Path) -> Iterator[ServerProcess]:
    server = tiny_server(tiny_model, *COMPARED, "-tp", "2", "--distributed-executor-backend", "ray",
                         roots=(probe_site,), log_path=probe_file.with_suffix(".log"),
                         RAY_ADDRESS=ray_address, GATEWAY_TEST_ROLE_PROBE_FILE=str(probe_file),
                         RAY_USAGE_STATS_ENABLED="0")
    with server:
        yield server


def test_ray_ranks_load_their_plugins_and_answer_as_one_rank_does(ray_server, probe_file,
                                                                  tiny_model):
    answer = httpx.post(ray_server.url("/v1/completions"), timeout=60, json={
        "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    records = httpx.get(ray_server.url("/v1/plugins"), timeout=10).json()["data"]
    assert answer.status_code == 200, answer.text
    roles = _pids_by_role(probe_file)
    assert sorted(roles) == ["api-server", "engine-core", "worker-0", "worker-1"]
    assert all(len(pids) == 1 for pids in roles.values())  # once per process
    workers = {(role, roles[role][0]) for role in ("worker-0", "worker-1")}
    seen = {(r["process_role"], r["pid"]) for r in records
            if r["name"] == "role_probe" and r["outcome"] == "called"}
    assert workers <= seen
    # Ray forwards an actor's output to the driver in batches: rank 1's lines may lag.
    deadline = time.monotonic() + 30
    while (f"(RayRank pid={roles['worker-1'][0]})" not in ray_server.log_text()
           and time.monotonic() < deadline):
        time.sleep(0.5)
    assert f"(RayRank pid={roles['worker-1'][0]})" in ray_server.log_text()
    assert [answer.json()["choices"][0]["text"]] == _single_engine_texts(tiny_model, [PROMPT])


def test_ray_ranks_under_async_scheduling_answer_as_one_rank_does(tiny_model, ray_address,
                                                                  tmp_path):
    """--async-scheduling over Ray actors: the steps go ahead through mp's sender thread."""
    server = tiny_server(tiny_model, *COMPARED, "-tp", "2", "--distributed-executor-backend",
                         "ray", "--async-scheduling", log_path=tmp_path / "ray-async.log",
                         RAY_ADDRESS=ray_address, RAY_USAGE_STATS_ENABLED="0")
    with server:
        answer = httpx.post(server.url("/v1/completions"), timeout=60, json={
            "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert answer.status_code == 200, answer.text
    assert [answer.json()["choices"][0]["text"]] == _single_engine_texts(tiny_model, [PROMPT])


def test_a_killed_actor_ends_the_streams_and_leaves_nothing_running(ray_server, probe_file):
    # Last in the module: it ends the module's server.
    roles = _pids_by_role(probe_file)
    actors = {roles["worker-0"][0], roles["worker-1"][0]}
    outcomes: list[dict[str, Any]] = [{} for _ in range(2)]
    _kill_mid_stream(ray_server, ray_server.url("/v1/completions"), roles["worker-1"][0],
                     outcomes, ERROR_WITHIN_S, EXIT_WITHIN_S)
    assert "worker rank 1" in ray_server.log_text()
    assert not _alive_after(actors, 10.0), [pid for pid in actors if is_alive(pid)]
