"""End to end: `gateway serve -tp 2` with real worker processes. Each worker loads its own
plugins and its records reach /v1/plugins; a worker whose general plugin raises stops
start-up with a message naming plugin, rank and pid, leaving no process; a worker killed
mid-generation or while idle ends the server within 2 s the engine-death way; and two
ranks started as two separate commands (two "nodes" on loopback) serve together.

A probe plugin (a general plugin installed as a real distribution) writes "ROLE PID" for
every process that loads it, which is how the tests know each worker's pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.plugins import GENERAL_PLUGINS_GROUP, LOGITS_PROCESSORS_GROUP
from tests.frontend.conftest import TINY_FLAGS, tiny_server
from tests.plugin_dists import subprocess_env, write_dist
from tests.server import (
    ServerProcess,
    _own_session_dying_with_parent,
    descendant_pids,
    free_port,
    is_alive,
    poll_status,
)

pytestmark = pytest.mark.e2e

ERROR_WITHIN_S = 2.0
EXIT_WITHIN_S = 15.0
PROBE_SOURCE = """
import os
from gateway.plugins.process import process_role

def register():
    with open(os.environ["TP_PROBE_FILE"], "a") as log:
        log.write(f"{process_role()} {os.getpid()}\\n")
    if process_role() == os.environ.get("TP_PROBE_FAIL_IN"):
        raise RuntimeError(f"no device for {process_role()}")
"""
LOGITS_SOURCE = """
from gateway.plugins import LogitsProcessor

class Identity(LogitsProcessor):
    def __init__(self, config, device, is_pin_memory):
        pass
    def is_argmax_invariant(self):
        return True
    def update_state(self, batch_update):
        pass
    def apply(self, logits):
        return logits
"""


@pytest.fixture(scope="module")
def probe_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dist(tmp_path_factory.mktemp("tp-probe"), "tp-probe",
                      {GENERAL_PLUGINS_GROUP: {"tp_probe": "tp_probe:register"},
                       LOGITS_PROCESSORS_GROUP: {"tp_identity": "tp_identity:Identity"}},
                      {"tp_probe": PROBE_SOURCE, "tp_identity": LOGITS_SOURCE})


def _server(model: Path, probe_site: Path, probe_file: Path, *flags: str,
            **env: str) -> ServerProcess:
    return tiny_server(model, "-tp", "2", *flags, roots=(probe_site,),
                       log_path=probe_file.with_suffix(".log"), TP_PROBE_FILE=str(probe_file),
                       **env)


def _alive_after(pids: set[int], seconds: float) -> list[int]:
    """Those of `pids` still alive after up to `seconds` (children may take a moment)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(is_alive(pid) for pid in pids):
        time.sleep(0.05)
    return [pid for pid in pids if is_alive(pid)]


def _pids_by_role(probe_file: Path) -> dict[str, list[int]]:
    roles: dict[str, list[int]] = {}
    for line in probe_file.read_text().splitlines():
        role, pid = line.split()
        roles.setdefault(role, []).append(int(pid))
    return roles


def test_each_worker_loads_its_plugins_and_its_records_reach_the_front_end(
        tiny_model, probe_site, tmp_path):
    probe = tmp_path / "probe.txt"
    with _server(tiny_model, probe_site, probe) as server:
        answer = httpx.post(server.url("/v1/completions"), timeout=60, json={
            "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        records = httpx.get(server.url("/v1/plugins"), timeout=10).json()["data"]
        metrics = httpx.get(server.url("/metrics"), timeout=10).text
        server_tree = descendant_pids(server.process.pid)
    assert answer.status_code == 200, answer.text
    memory = {line.split('"')[1] for line in metrics.splitlines()
              if line.startswith("process_resident_memory_bytes{")}
    assert memory == {"api-server", "engine-core", "worker-0", "worker-1"}
    collected = {line.split('process="')[1].split('"')[0] for line in metrics.splitlines()
                 if line.startswith("python_gc_collections_total{")}
    assert collected == {"api-server", "engine-core", "worker-0", "worker-1"}
    assert answer.json()["usage"]["completion_tokens"] == 8
    roles = _pids_by_role(probe)
    # Once per process: each process that loads plugins called the probe once.
    assert sorted(roles) == ["api-server", "engine-core", "worker-0", "worker-1"]
    assert all(len(pids) == 1 for pids in roles.values())
    workers = {f"worker-{rank}": roles[f"worker-{rank}"][0] for rank in (0, 1)}
    assert set(workers.values()) <= server_tree and len(set(workers.values())) == 2
    for group, outcome in ((GENERAL_PLUGINS_GROUP, "called"), (LOGITS_PROCESSORS_GROUP, "loaded")):
        seen = {(r["process_role"], r["pid"]) for r in records
                if r["group"] == group and r["distribution"] == "tp-probe"
                and r["outcome"] == outcome and r["process_role"].startswith("worker-")}
        assert seen == set(workers.items()), (group, records)


def test_a_worker_whose_general_plugin_raises_stops_start_up_and_leaves_no_process(
        tiny_model, probe_site, tmp_path):
    probe = tmp_path / "probe.txt"
    server = _server(tiny_model, probe_site, probe, TP_PROBE_FAIL_IN="worker-1")
    with pytest.raises(RuntimeError, match="exited with 1 before it was ready"):
        server.start()
    roles = _pids_by_role(probe)
    (failed_pid,) = roles["worker-1"]
    log = server.log_text()
    assert (f"worker rank 1 (pid {failed_pid} on " in log
            and f"failed to start: PluginError: General plugin 'tp_probe' (group "
                f"vllm.general_plugins, distribution tp-probe) in process worker-1 (pid "
                f"{failed_pid}) raised: RuntimeError: no device for worker-1" in log), log
    assert not _alive_after({pid for pids in roles.values() for pid in pids}, 5.0)


def _generate_in_background(url: str, outcomes: list[dict[str, Any]]) -> list[threading.Thread]:
    def stream(outcome: dict[str, Any]) -> None:
        try:
            with httpx.Client(timeout=30) as client, client.stream("POST", url, json={
                    # Near the 2048-token context: no stream may end before the kill reaches
                    # it, even when the last of several starts late on a loaded machine.
                    "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True,
                    "stream": True}) as response:
                events = []
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        outcome["started"] = True
                outcome["events"] = events
        except httpx.HTTPError as exc:
            outcome["transport_error"] = repr(exc)
        outcome["ended_at"] = time.monotonic()

    threads = [threading.Thread(target=stream, args=(outcome,)) for outcome in outcomes]
    for thread in threads:
        thread.start()
    return threads


def _kill_mid_stream(server: ServerProcess, url: str, pid: int, outcomes: list[dict[str, Any]],
                     error_within_s: float = ERROR_WITHIN_S,
                     exit_within_s: float = EXIT_WITHIN_S, hold: int | None = None) -> None:
    """Stream into `outcomes` (one request each), SIGKILL `pid` once all have started, and
    check the engine-death way: /health 503 within `error_within_s`, every stream ended by
    then with an `engine_dead` event and `[DONE]`, and the server exits non-zero. `hold`: a
    process that serves some of the streams and survives the kill (another data-parallel
    engine), stopped from just before the kill until /health reports it, so that its
    streams cannot finish on their own while the server notices (a fast machine made the
    rest of 2000 tokens in that time).

    The kill must find every stream in flight. On a loaded 2-core machine the last stream
    can start seconds after the first, and a fast engine finishes 2000 tokens in that time
    (seen in CI); such a round is left to end and a fresh one started, so what the
    assertions see is always streams cut by the kill."""
    for _ in range(3):
        threads = _generate_in_background(url, outcomes)
        deadline = time.monotonic() + 60
        while (not all(o.get("started") or "ended_at" in o for o in outcomes)
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert all(o.get("started") or "ended_at" in o for o in outcomes), server.log_tail()
        if not any("ended_at" in o for o in outcomes):
            break
        for thread in threads:
            thread.join(timeout=120)
        assert all(o.get("events", [""])[-1] == "[DONE]" for o in outcomes), outcomes
        for outcome in outcomes:
            outcome.clear()
    else:
        raise AssertionError("in three rounds a stream ended before the last one started")

    if hold is not None:
        os.kill(hold, signal.SIGSTOP)
    try:
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        health = poll_status(server.url("/health"), 503, error_within_s)
    finally:
        if hold is not None:
            os.kill(hold, signal.SIGCONT)
    assert health is not None and health.status_code == 503, server.log_tail()
    for thread in threads:
        thread.join(timeout=error_within_s + 5)
    for outcome in outcomes:
        assert outcome["ended_at"] - killed_at < error_within_s, outcome
        assert "transport_error" not in outcome and outcome["events"][-1] == "[DONE]"
        assert "engine_dead" in outcome["events"][-2]
    assert server.wait_exit(exit_within_s) != 0


@pytest.mark.parametrize(("victim", "busy"), [("worker-1", True), ("worker-0", False)],
                         ids=["rank-1-while-generating", "rank-0-while-idle"])
def test_a_killed_worker_ends_the_server_the_engine_death_way(
        tiny_model, probe_site, tmp_path, victim, busy):
    probe = tmp_path / "probe.txt"
    server = _server(tiny_model, probe_site, probe).start()
    try:
        children = descendant_pids(server.process.pid)
        outcomes: list[dict[str, Any]] = [{} for _ in range(2 if busy else 0)]
        _kill_mid_stream(server, server.url("/v1/completions"),
                         _pids_by_role(probe)[victim][0], outcomes)
        rank = victim.removeprefix("worker-")
        assert f"worker rank {rank} (pid" in server.log_text()
        assert "was killed by SIGKILL" in server.log_text()
        assert not _alive_after(children, 5.0)
    finally:
        server.stop()
    assert not server.leftover_pids


def test_ranks_started_as_two_commands_serve_together(tiny_model, probe_site, tmp_path):
    port = free_port()
    nodes = ("-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port",
             str(port))
    probe = tmp_path / "probe.txt"
    env = subprocess_env(probe_site, TP_PROBE_FILE=str(probe))
    with open(tmp_path / "node1.log", "wb") as node1_log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "gateway.frontend.cli.main", "serve", str(tiny_model),
             *TINY_FLAGS, *nodes, "--headless", "--node-rank", "1"],
            stdout=node1_log, stderr=subprocess.STDOUT, env=env,
            preexec_fn=_own_session_dying_with_parent)  # noqa: PLW1509
    try:
        node1_tree: set[int] = set()
        server = tiny_server(tiny_model, *nodes, roots=(probe_site,),
                             log_path=tmp_path / "node0.log", TP_PROBE_FILE=str(probe))
        with server:
            node1_tree = descendant_pids(node1.pid)
            answer = httpx.post(server.url("/v1/completions"), timeout=60, json={
                "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
            records = httpx.get(server.url("/v1/plugins"), timeout=10).json()["data"]
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 8
        roles = _pids_by_role(probe)
        assert roles["worker-1"][0] in node1_tree  # rank 1 runs under the headless command
        assert roles["worker-0"][0] not in node1_tree
        assert {(r["process_role"], r["pid"]) for r in records if r["name"] == "tp_probe"} >= {
            ("worker-0", roles["worker-0"][0]), ("worker-1", roles["worker-1"][0])}
        # The server's shutdown reaches rank 1 through rank 0: node 1 ends by itself.
        assert node1.wait(timeout=EXIT_WITHIN_S) == 0
        assert not _alive_after(node1_tree, 5.0)
        assert not server.leftover_pids
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
