"""End to end: `gateway serve --api-server-count 2` (tiny model): both API servers answer on
the one port, each with the endpoint plugin loaded and initialised in it; /v1/plugins on
either lists every process; /metrics on either counts every token the requests received;
the stat-logger plugin runs once, in API server 0, with every request; a stopped engine
core (SIGSTOP) turns /health to 503 on both API servers until it resumes; killing an API
server stops the whole server (exit code 1, no process left).

One server for the module: the last test kills one of its API servers.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gateway.plugins import (
    ENDPOINT_PLUGINS_GROUP,
    GENERAL_PLUGINS_GROUP,
    STAT_LOGGER_PLUGINS_GROUP,
)
from tests.frontend.conftest import SERVED_NAME, tiny_server
from tests.plugin_dists import write_dist
from tests.reliability.test_stalls_and_shedding import Stream
from tests.server import descendant_pids, is_alive

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 8
ENGINE_THRESHOLD_S = 1.0
API_SERVERS = {"api-server-0", "api-server-1"}

SOURCE = '''
import json
import os

from fastapi import APIRouter

from gateway.plugins import StatLoggerBase


class PidPlugin:
    """GET /v1/asc-pid: the pid that answered, and the pid its init_state ran in."""

    name = "asc_pid"
    required_tasks = None

    def __init__(self):
        self.init_pid = None

    def attach_router(self, app):
        router = APIRouter()

        async def pid():
            return {"pid": os.getpid(), "init_pid": self.init_pid}

        router.add_api_route("/v1/asc-pid", pid, methods=["GET"])
        app.include_router(router)

    async def init_state(self, engine_client, state, args):
        self.init_pid = os.getpid()


def pid_plugin():
    return PidPlugin()


class TallyLogger(StatLoggerBase):
    """Appends one line per finished request (with the pid that recorded it)."""

    def __init__(self, config, engine_index=0):
        super().__init__(config, engine_index)
        self.fd = os.open(os.environ["ASC_TALLY_FILE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def record(self, scheduler_stats, iteration_stats, engine_idx=0):
        if iteration_stats is None:
            return
        lines = "".join(json.dumps({"pid": os.getpid(), "request_id": r.request_id,
                                    "prompt": r.num_prompt_tokens,
                                    "generation": r.num_generation_tokens}) + "\\n"
                        for r in iteration_stats.finished_requests)
        if lines:
            os.write(self.fd, lines.encode())

    def log_engine_initialized(self):
        pass


def general():
    pass
'''


@pytest.fixture(scope="module")
def tally(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tally") / "finished.jsonl"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory, tally):
    site = write_dist(tmp_path_factory.mktemp("asc-site"), "gw-test-asc", {
        ENDPOINT_PLUGINS_GROUP: {"asc_pid": "gw_test_asc:pid_plugin"},
        STAT_LOGGER_PLUGINS_GROUP: {"asc_tally": "gw_test_asc:TallyLogger"},
        GENERAL_PLUGINS_GROUP: {"asc_general": "gw_test_asc:general"},
    }, {"gw_test_asc": SOURCE})
    log = tmp_path_factory.mktemp("logs") / "api-servers.log"
    with tiny_server(tiny_model, "--api-server-count", "2",
                     "--engine-stall-threshold", str(ENGINE_THRESHOLD_S), roots=(site,),
                     log_path=log,
                     VLLM_PLUGINS="asc_pid,asc_tally,asc_general",
                     ASC_TALLY_FILE=str(tally)) as server:
        yield server


def _fresh_get(server, path: str) -> httpx.Response:
    """A GET on a new connection, which either API server may accept."""
    return httpx.get(server.url(path), timeout=30)


@pytest.fixture(scope="module")
def answering_pids(server) -> dict[int, int]:
    """pid -> init_pid, from new connections until both API servers answered."""
    seen: dict[int, int] = {}
    for _ in range(200):
        body = _fresh_get(server, "/v1/asc-pid").json()
        seen[body["pid"]] = body["init_pid"]
        if len(seen) == 2:
            break
    return seen


@pytest.fixture(scope="module")
def records(server):
    return _fresh_get(server, "/v1/plugins").json()["data"]


def _roles(records, group: str, name: str) -> dict[str, dict]:
    return {r["process_role"]: r for r in records if (r["group"], r["name"]) == (group, name)}


def test_both_api_servers_answer_with_the_plugin_initialised_in_each(answering_pids,
                                                                      records):
    assert len(answering_pids) == 2
    assert all(pid == init_pid for pid, init_pid in answering_pids.items())
    endpoint = _roles(records, ENDPOINT_PLUGINS_GROUP, "asc_pid")
    assert set(endpoint) == API_SERVERS
    assert {r["pid"] for r in endpoint.values()} == set(answering_pids)
    assert all(r["outcome"] == "attached" for r in endpoint.values())


def test_the_plugin_report_lists_every_process_whichever_api_server_answers(server,
                                                                             records):
    general = _roles(records, GENERAL_PLUGINS_GROUP, "asc_general")
    assert set(general) == {"supervisor", "engine-core", *API_SERVERS}
    assert all(r["outcome"] == "called" for r in general.values())
    assert len({r["pid"] for r in general.values()}) == 4
    key = sorted((r["process_role"], r["pid"], r["group"], r["name"]) for r in records)
    for _ in range(6):
        again = _fresh_get(server, "/v1/plugins").json()["data"]
        assert sorted((r["process_role"], r["pid"], r["group"], r["name"])
                      for r in again) == key


def test_stat_logger_plugins_load_in_api_server_0_alone(records):
    assert set(_roles(records, STAT_LOGGER_PLUGINS_GROUP, "asc_tally")) == {"api-server-0"}


def _complete(server, index: int) -> dict:
    response = httpx.post(server.url("/v1/completions"), timeout=60, json={
        "model": SERVED_NAME, "prompt": f"request number {index} says", "max_tokens": 3 + index,
        "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def _counter(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _token_counters(server) -> tuple[float, float, float]:
    text = _fresh_get(server, "/metrics").text
    return (_counter(text, "vllm:prompt_tokens_total"),
            _counter(text, "vllm:generation_tokens_total"),
            _counter(text, "vllm:request_success_total"))


def test_metrics_on_either_api_server_count_every_token_the_requests_received(
        server, answering_pids, tally):
    before = _token_counters(server)
    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        bodies = list(pool.map(lambda i: _complete(server, i), range(NUM_REQUESTS)))
    prompt = sum(b["usage"]["prompt_tokens"] for b in bodies)
    generation = sum(b["usage"]["completion_tokens"] for b in bodies)
    expected = (before[0] + prompt, before[1] + generation, before[2] + NUM_REQUESTS)
    scrapes = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (len(scrapes) < 6 or scrapes[-1] != expected):
        scrapes.append(_token_counters(server))  # new connections: both API servers answer
    assert scrapes[-6:] == [expected] * 6
    finished = [json.loads(line) for line in tally.read_text().splitlines()]
    mine = {r["request_id"]: r for r in finished if r["request_id"] in
            {b["id"] for b in bodies}}
    assert len(mine) == NUM_REQUESTS  # each request recorded once, by one process
    assert {r["pid"] for r in finished} == {_pid_of(server, "api-server-0")}
    assert sum(r["generation"] for r in mine.values()) == generation


def test_the_stats_line_is_logged_by_api_server_0_alone(server):
    pids = {line.split("pid=")[1].split("]")[0] for line in server.log_text().splitlines()
            if "Engine 000: Avg prompt throughput" in line}
    assert pids <= {str(_pid_of(server, "api-server-0"))}


def _pid_of(server, role: str) -> int:
    records = _fresh_get(server, "/v1/plugins").json()["data"]
    (pid,) = {r["pid"] for r in records if r["process_role"] == role}
    return pid


def _get_on(server, pid: int, path: str) -> httpx.Response:
    """GET `path` from the API server `pid`: new connections until that API server accepts
    one, then the request on it at once. (A kept-alive connection is closed by the server
    when idle for its keep-alive timeout, and the one that replaces it may land on the
    other API server.)"""
    for _ in range(200):
        with httpx.Client(base_url=server.url(""), timeout=30) as client:
            if client.get("/v1/asc-pid").json()["pid"] == pid:
                return client.get(path)
    raise AssertionError(f"no connection reached API server {pid}")


def _api_server_pids(server) -> set[int]:
    """The API servers' pids, each seen answering."""
    pids: set[int] = set()
    for _ in range(200):
        with httpx.Client(base_url=server.url(""), timeout=30) as client:
            pids.add(client.get("/v1/asc-pid").json()["pid"])
        if len(pids) == 2:
            break
    return pids


def _poll_on(server, pid: int, path: str, status: int, within_s: float) -> httpx.Response:
    deadline = time.monotonic() + within_s
    response = _get_on(server, pid, path)
    while response.status_code != status and time.monotonic() < deadline:
        time.sleep(0.05)
        response = _get_on(server, pid, path)
    return response


def test_a_stopped_engine_core_is_unhealthy_on_every_api_server_until_it_resumes(server):
    pids = _api_server_pids(server)
    assert len(pids) == 2
    core = _pid_of(server, "engine-core")
    stream = Stream(server, max_tokens=600)  # on either API server: both see it pending
    stream.start()
    assert stream.started.wait(60), server.log_tail()
    os.kill(core, signal.SIGSTOP)
    try:
        for pid in pids:
            health = _poll_on(server, pid, "/health", 503, ENGINE_THRESHOLD_S + 5)
            assert health.status_code == 503, (pid, server.log_tail())
            assert health.json()["error"]["code"] == "engine_stalled"
            assert "sent no heartbeat" in health.json()["error"]["message"]
    finally:
        os.kill(core, signal.SIGCONT)
    for pid in pids:
        assert _poll_on(server, pid, "/health", 200, 10).status_code == 200, \
            (pid, server.log_tail())
    warned = sorted(line.split("pid=")[1].split("]")[0]
                    for line in server.log_text().splitlines() if "Engine stalled" in line)
    assert warned == sorted(str(pid) for pid in pids)  # each API server, once each
    stream.join(60)
    assert stream.status == 200 and stream.events[-1] == "[DONE]"
    assert stream.completion_tokens == 600


def test_a_killed_api_server_stops_the_whole_server(server):
    """Runs last: the server does not serve after it."""
    victim = _pid_of(server, "api-server-1")
    started = descendant_pids(server.process.pid)
    os.kill(victim, signal.SIGKILL)
    assert server.wait_exit(timeout_s=60) == 1
    assert f"API server 1 (pid {victim}) exited with code -9; the server stops" \
        in server.log_text()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(is_alive(p) for p in started):
        time.sleep(0.05)
    assert [p for p in started if is_alive(p)] == []
