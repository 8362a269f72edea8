"""End to end, on a real server of the tiny model: requests that arrive while the engine
core is stalled get the queue deadline from their arrival. The front end refuses them
there (503 queue_timeout with Retry-After, counted) while the core is still stopped, and
/health's 503 reason counts them while they wait.

The repro: such requests waited the whole stall, and their wait did not count toward
--max-queue-time. The core is stopped with SIGSTOP; one sequence runs at a time.
"""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from tests.frontend.conftest import SERVED_NAME, tiny_server
from tests.reliability.test_engine_death import _engine_core_pid
from tests.reliability.test_stalls_and_shedding import Answer, Stream, _sample
from tests.server import poll_status

pytestmark = pytest.mark.e2e

STALL_THRESHOLD_S = 0.5
MAX_QUEUE_TIME_S = 3.0
NUM_ARRIVING = 2


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "stall-deadlines.log"
    with tiny_server(tiny_model, "--max-num-seqs", "1",
                     "--max-queue-time", str(MAX_QUEUE_TIME_S),
                     "--engine-stall-threshold", str(STALL_THRESHOLD_S),
                     log_path=log) as server:
        yield server
    assert server.process.returncode == 0, server.log_tail()


def _load(server) -> int:
    return httpx.get(server.url("/load"), timeout=10).json()["server_load"]


def test_requests_arriving_in_a_stall_are_refused_at_their_deadline_and_counted(server):
    timeouts_before = _sample(server, "gateway_requests_rejected_total",
                              'reason="queue_timeout"')
    running = Stream(server, max_tokens=1000)  # started before the stall: it waits it out
    running.start()
    assert running.started.wait(60), server.log_tail()
    core = _engine_core_pid(server)
    os.kill(core, signal.SIGSTOP)
    try:
        health = poll_status(server.url("/health"), 503, STALL_THRESHOLD_S + 5)
        assert health is not None and health.status_code == 503, server.log_tail()
        arriving = [Answer(server, "/v1/completions", {
            "model": SERVED_NAME, "prompt": "Hi", "max_tokens": 4})
            for _ in range(NUM_ARRIVING)]
        sent_at = time.monotonic()
        for answer in arriving:
            answer.start()
        deadline = time.monotonic() + 5
        while _load(server) < 1 + NUM_ARRIVING:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # The stall's reason counts them (it is refreshed at each liveness check).
        counted = f"with {1 + NUM_ARRIVING} requests pending ({NUM_ARRIVING} of them " \
                  "arrived since)"
        deadline = time.monotonic() + 2
        message = ""
        while counted not in message and time.monotonic() < deadline:
            message = httpx.get(server.url("/health"), timeout=10).json()["error"]["message"]
            time.sleep(0.05)
        assert counted in message, message
        for answer in arriving:  # refused while the core is still stopped
            answer.join(MAX_QUEUE_TIME_S + 10)
            assert answer.response is not None
        refused_after = time.monotonic() - sent_at
        assert _load(server) == 1  # only the running stream is left
    finally:
        os.kill(core, signal.SIGCONT)
    assert MAX_QUEUE_TIME_S <= refused_after < MAX_QUEUE_TIME_S + 3, refused_after
    for answer in arriving:
        assert answer.response.status_code == 503, answer.response.text
        error = answer.response.json()["error"]
        assert error["code"] == "queue_timeout", error
        assert f"over the limit of {MAX_QUEUE_TIME_S:g} s (--max-queue-time)" in error["message"]
        assert "while no engine step completed" in error["message"], error
        waited = float(re.search(r"waited ([\d.]+) s", error["message"]).group(1))
        assert MAX_QUEUE_TIME_S <= waited < MAX_QUEUE_TIME_S + 2, error
        assert 1 <= int(answer.response.headers["retry-after"]) <= 60
    assert _sample(server, "gateway_requests_rejected_total",
                   'reason="queue_timeout"') == timeouts_before + NUM_ARRIVING
    running.join(120)
    assert running.status == 200 and running.events[-1] == "[DONE]"  # admitted: finished
    assert running.completion_tokens == 1000
    assert poll_status(server.url("/health"), 200, 10).status_code == 200
    assert _load(server) == 0


def test_a_request_that_never_waits_past_its_deadline_is_served_after_a_stall(server):
    """A short stall: the request arrived in it but was not due yet, so it is served."""
    core = _engine_core_pid(server)
    os.kill(core, signal.SIGSTOP)
    try:
        answer = Answer(server, "/v1/completions", {
            "model": SERVED_NAME, "prompt": "Hi", "max_tokens": 4})
        answer.start()
        time.sleep(MAX_QUEUE_TIME_S / 3)
    finally:
        os.kill(core, signal.SIGCONT)
    answer.join(60)
    assert answer.response is not None and answer.response.status_code == 200, \
        answer.response.text
