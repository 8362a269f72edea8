"""End to end, on one real tensor-parallel server (two worker processes) of the tiny model:

- a stopped worker (SIGSTOP) leaves the engine core alive but stuck: /health answers 503
  saying so, and recovers after SIGCONT, the stream in flight finishing whole;
- SIGTERM drains: new requests get 503 while the server still listens, running streams
  get `--shutdown-timeout` seconds and then an SSE error event and `data: [DONE]`, and the
  server exits 0 with no traceback in its log.

The drain ends the server, so it is the module's last test.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from tests.frontend.conftest import SERVED_NAME, tiny_server
from tests.reliability.test_engine_death import _cmdline, _engine_core_pid
from tests.reliability.test_stalls_and_shedding import Stream, _sample
from tests.server import descendant_pids, poll_status

pytestmark = pytest.mark.e2e

ENGINE_THRESHOLD_S = 1.0
SHUTDOWN_TIMEOUT_S = 2.0
NUM_STREAMS = 3


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "tp-drain.log"
    server = tiny_server(tiny_model, "-tp", "2",
                         "--engine-stall-threshold", str(ENGINE_THRESHOLD_S),
                         "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), log_path=log).start()
    yield server
    server.stop()
    assert not server.leftover_pids


def _a_worker_pid(server) -> int:
    core = _engine_core_pid(server)
    workers = [pid for pid in descendant_pids(core) if b"spawn_main" in _cmdline(pid)]
    assert len(workers) == 2, workers
    return max(workers)


def test_a_stopped_worker_leaves_the_engine_alive_but_stuck_until_it_resumes(server):
    worker = _a_worker_pid(server)
    stream = Stream(server, max_tokens=40)
    stream.start()
    assert stream.started.wait(60), server.log_tail()
    os.kill(worker, signal.SIGSTOP)
    try:
        health = poll_status(server.url("/health"), 503, ENGINE_THRESHOLD_S + 5)
        assert health is not None and health.status_code == 503, server.log_tail()
        error = health.json()["error"]
        assert error["code"] == "engine_stalled"
        assert "alive but stuck at step" in error["message"], error
        assert _sample(server, "gateway_engine_stalled") == 1
    finally:
        os.kill(worker, signal.SIGCONT)
    health = poll_status(server.url("/health"), 200, 10)
    assert health is not None and health.status_code == 200, server.log_tail()
    assert _sample(server, "gateway_engine_stalled") == 0
    stream.join(60)
    assert stream.status == 200 and stream.completion_tokens == 40


def test_sigterm_refuses_new_requests_and_ends_running_streams_cleanly(server):
    streams = [Stream(server, max_tokens=2000) for _ in range(NUM_STREAMS)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(60), server.log_tail()
    server.process.send_signal(signal.SIGTERM)
    signalled_at = time.monotonic()
    health = poll_status(server.url("/health"), 503, 2)  # still listening, saying why
    assert health is not None and health.json()["error"]["code"] == "shutting_down"
    refused = httpx.post(server.url("/v1/completions"), timeout=10, json={
        "model": SERVED_NAME, "prompt": "Hi", "max_tokens": 4})
    assert refused.status_code == 503 and refused.headers["connection"] == "close"
    assert refused.json()["error"]["code"] == "shutting_down"

    for stream in streams:
        stream.join(SHUTDOWN_TIMEOUT_S + 30)
        assert not stream.is_alive()
    ended_after = time.monotonic() - signalled_at
    assert SHUTDOWN_TIMEOUT_S * 0.9 <= ended_after < SHUTDOWN_TIMEOUT_S + 10
    for stream in streams:
        assert stream.status == 200 and stream.events[-1] == "[DONE]", stream.events[-3:]
        error = json.loads(stream.events[-2])["error"]
        assert error["code"] == "shutting_down" and error["type"] == "server_error"
    assert server.wait_exit(30) == 0, server.log_tail()
    log = server.log_text()
    assert "Traceback" not in log, server.log_tail()
    assert f"Drain time over: ended {NUM_STREAMS} requests" in log
