"""End to end, on one real server of the tiny model: a blocking plugin route is named and
counted, a slow one is cut by `--plugin-route-timeout` (504), a stopped engine core turns
/health to 503 until it resumes, and load beyond
`--max-num-queued-reqs` / `--max-queue-time` is refused with 503 and Retry-After while
admitted requests finish whole.

The server runs one sequence at a time (`--max-num-seqs 1`), so a second request waits in
the engine's queue; thresholds are short so that each case takes a few seconds. Where a
case needs the queue to stand still, the engine core is stopped (SIGSTOP) meanwhile.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from tests.frontend.conftest import SERVED_NAME, tiny_server
from tests.plugin_dists import write_dist
from tests.reliability.test_engine_death import _engine_core_pid
from tests.server import poll_status

pytestmark = pytest.mark.e2e

BLOCK_S = 1.0
LOOP_THRESHOLD_S = 0.25
ENGINE_THRESHOLD_S = 1.0
MAX_QUEUED = 3
MAX_QUEUE_TIME_S = 1.0
PLUGIN_ROUTE_TIMEOUT_S = 3.0
LONG = {"model": SERVED_NAME, "prompt": "Once upon a time", "max_tokens": 1500,
        "ignore_eos": True}

PLUGIN_SOURCE = f'''
import asyncio
import time
from fastapi import APIRouter


class Blocking:
    name = "blocking"
    required_tasks = None

    def attach_router(self, app):
        router = APIRouter()

        @router.get("/v1/block")
        async def block():  # wrong: blocks the event loop
            time.sleep({BLOCK_S})
            return {{"blocked": True}}

        @router.get("/v1/slow")
        async def slow():  # awaits longer than --plugin-route-timeout
            await asyncio.sleep(60)

        @router.get("/v1/block-in-thread")
        def block_in_thread():  # right: a plain def runs in the thread pool
            time.sleep({BLOCK_S})
            return {{"blocked": False}}

        app.include_router(router)

    async def init_state(self, engine_client, state, args):
        pass


def make():
    return Blocking()
'''


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    site = tmp_path_factory.mktemp("blocking-plugin")
    write_dist(site, "gw-test-blocking", {"vllm.endpoint_plugins": {
        "blocking": "gw_test_blocking:make"}}, {"gw_test_blocking": PLUGIN_SOURCE})
    log = tmp_path_factory.mktemp("logs") / "stalls.log"
    with tiny_server(tiny_model, "--max-num-seqs", "1",
                     "--max-num-queued-reqs", str(MAX_QUEUED),
                     "--max-queue-time", str(MAX_QUEUE_TIME_S),
                     "--engine-stall-threshold", str(ENGINE_THRESHOLD_S),
                     "--event-loop-stall-threshold", str(LOOP_THRESHOLD_S),
                     "--plugin-route-timeout", str(PLUGIN_ROUTE_TIMEOUT_S),
                     roots=(site,), log_path=log, VLLM_PLUGINS="blocking") as server:
        yield server
    assert server.process.returncode == 0, server.log_tail()


def _sample(server, name: str, labels: str = "") -> float:
    """A sample of /metrics (0.0 while the labelled series does not exist yet)."""
    text = httpx.get(server.url("/metrics"), timeout=30).text
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else r"")
    match = re.search(r"^" + pattern + r"\s+(\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


class Stream(threading.Thread):
    """A streamed completion read to its end in a thread: its status, events, and the
    largest gap between two events."""

    def __init__(self, server, **body) -> None:
        super().__init__(daemon=True)
        self.url = server.url("/v1/completions")
        self.body = {**LONG, **body, "stream": True, "stream_options": {"include_usage": True}}
        self.started = threading.Event()
        self.status: int | None = None
        self.events: list[str] = []
        self.headers: dict[str, str] = {}
        self.largest_gap_s = 0.0

    def run(self) -> None:
        with httpx.Client(timeout=120) as client, client.stream("POST", self.url,
                                                                  json=self.body) as response:
            self.status, self.headers = response.status_code, dict(response.headers)
            last = None
            for line in response.iter_lines():
                if line.startswith("data: "):
                    now = time.monotonic()
                    if last is not None and self.events:
                        self.largest_gap_s = max(self.largest_gap_s, now - last)
                    last = now
                    self.events.append(line[len("data: "):])
                    self.started.set()
                elif line.startswith("{"):  # a whole error body
                    self.events.append(line)
            self.started.set()

    @property
    def completion_tokens(self) -> int:
        """The usage chunk's count (the one before [DONE])."""
        return int(json.loads(self.events[-2])["usage"]["completion_tokens"])


def test_a_blocking_plugin_route_is_named_in_one_warning_and_counted(server):
    stream = Stream(server, max_tokens=600)
    stream.start()
    assert stream.started.wait(60), server.log_tail()
    stalls_before = _sample(server, "gateway_event_loop_stall_seconds_count")
    response = httpx.get(server.url("/v1/block"), timeout=30)
    assert response.status_code == 200
    request_id = response.headers["x-request-id"]
    time.sleep(4 * LOOP_THRESHOLD_S)  # the watchdog's timer reports when the loop wakes

    lines = [line for line in server.log_text().splitlines()
             if "event loop was blocked" in line and request_id in line]
    assert len(lines) == 1, server.log_tail()
    assert "plugin 'blocking' route GET /v1/block " in lines[0] and "WARNING" in lines[0]
    assert "in block" in lines[0]  # the line it was on: the handler
    blocked_s = float(re.search(r"blocked for ([\d.]+) s", lines[0]).group(1))
    assert BLOCK_S - 2 * LOOP_THRESHOLD_S <= blocked_s <= BLOCK_S + 2.0
    assert _sample(server, "gateway_plugin_route_stalls_total",
                   'plugin="blocking",route="/v1/block"') == 1
    # At least this one (a starved CPU can stall the loop too).
    assert _sample(server, "gateway_event_loop_stall_seconds_count") >= stalls_before + 1
    stream.join(60)
    assert stream.events[-1] == "[DONE]"
    assert stream.largest_gap_s >= BLOCK_S - 2 * LOOP_THRESHOLD_S  # it did freeze the stream


def test_a_plain_def_route_blocks_nothing(server):
    stream = Stream(server, max_tokens=400)
    stream.start()
    assert stream.started.wait(60), server.log_tail()
    response = httpx.get(server.url("/v1/block-in-thread"), timeout=30)
    assert response.status_code == 200 and response.json() == {"blocked": False}
    time.sleep(4 * LOOP_THRESHOLD_S)
    stream.join(60)
    assert stream.events[-1] == "[DONE]"
    assert _sample(server, "gateway_plugin_route_stalls_total",
                   'plugin="blocking",route="/v1/block-in-thread"') == 0
    request_id = response.headers["x-request-id"]
    assert request_id not in server.log_text()  # no stall warning names it


def test_a_plugin_route_past_its_timeout_gets_504(server):
    started = time.monotonic()
    response = httpx.get(server.url("/v1/slow"), timeout=60)
    took = time.monotonic() - started
    assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
    assert PLUGIN_ROUTE_TIMEOUT_S <= took < PLUGIN_ROUTE_TIMEOUT_S + 10
    assert "Plugin route GET /v1/slow did not answer within" in server.log_text()
    assert httpx.get(server.url("/v1/models")).status_code == 200  # the server serves on


def test_a_stopped_engine_core_is_unhealthy_until_it_resumes(server):
    core = _engine_core_pid(server)
    stream = Stream(server, max_tokens=600)
    stream.start()
    assert stream.started.wait(60), server.log_tail()
    os.kill(core, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        health = poll_status(server.url("/health"), 503, ENGINE_THRESHOLD_S + 5)
        assert health is not None and health.status_code == 503, server.log_tail()
        assert time.monotonic() - stopped_at >= ENGINE_THRESHOLD_S * 0.9
        error = health.json()["error"]
        assert error["code"] == "engine_stalled"
        assert "sent no heartbeat" in error["message"], error  # the core itself is frozen
        assert _sample(server, "gateway_engine_stalled") == 1
        time.sleep(1.0)  # still stalled: one WARNING, not one per check
    finally:
        os.kill(core, signal.SIGCONT)
    health = poll_status(server.url("/health"), 200, 10)
    assert health is not None and health.status_code == 200, server.log_tail()
    assert _sample(server, "gateway_engine_stalled") == 0
    warnings = [line for line in server.log_text().splitlines() if "Engine stalled" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0]
    assert "Engine stall over" in server.log_text()
    stream.join(60)
    assert stream.status == 200 and stream.events[-1] == "[DONE]"  # it waited, then finished
    assert stream.completion_tokens == 600


def test_load_beyond_the_queue_limits_gets_503_with_retry_after(server):
    full_before = _sample(server, "gateway_requests_rejected_total", 'reason="queue_full"')
    timeout_before = _sample(server, "gateway_requests_rejected_total",
                             'reason="queue_timeout"')
    running = Stream(server)
    running.start()
    assert running.started.wait(60), server.log_tail()
    core = _engine_core_pid(server)
    os.kill(core, signal.SIGSTOP)  # holds the queue still, whatever the machine's speed
    try:
        queued = [Stream(server) for _ in range(MAX_QUEUED - 1)]  # behind the running one
        for stream in queued:
            stream.start()
        deadline = time.monotonic() + 10
        while httpx.get(server.url("/load")).json()["server_load"] < MAX_QUEUED:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        refused = httpx.post(server.url("/v1/completions"), json={**LONG, "max_tokens": 4})
        time.sleep(MAX_QUEUE_TIME_S + 0.5)  # the queued ones are past their deadline now
    finally:
        os.kill(core, signal.SIGCONT)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "queue_full"
    assert refused.json()["error"]["type"] == "server_error"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    for stream in queued:  # over --max-queue-time without starting: told to retry
        stream.join(30)
        assert stream.status == 503, stream.events
        assert '"queue_timeout"' in stream.events[0]
        assert 1 <= int(stream.headers["retry-after"]) <= 60
    running.join(60)
    assert running.status == 200 and running.events[-1] == "[DONE]"  # admitted: finished
    assert running.completion_tokens == LONG["max_tokens"]
    assert _sample(server, "gateway_requests_rejected_total",
                   'reason="queue_full"') == full_before + 1
    assert _sample(server, "gateway_requests_rejected_total",
                   'reason="queue_timeout"') == timeout_before + len(queued)
    assert httpx.get(server.url("/load")).json()["server_load"] == 0


# ------------------------------------------------------------------ the request's own deadline
class Answer(threading.Thread):
    """A non-streamed request in a thread: its response."""

    def __init__(self, server, path: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = server.url(path), body
        self.response: httpx.Response | None = None

    def run(self) -> None:
        self.response = httpx.post(self.url, json=self.body, timeout=120)


OWN_DEADLINE_S = 0.3  # shorter than the server's MAX_QUEUE_TIME_S


def test_a_request_is_refused_at_its_own_shorter_queue_deadline(server):
    timeouts_before = _sample(server, "gateway_requests_rejected_total",
                              'reason="queue_timeout"')
    running = Stream(server, max_tokens=1200)  # holds the one sequence slot
    running.start()
    assert running.started.wait(60), server.log_tail()
    # The engine stopped while both wait past their own deadline (a fast machine made the
    # running one's 1,200 tokens within it); they are refused when it goes on.
    os.kill(_engine_core_pid(server), signal.SIGSTOP)
    try:
        stream = Stream(server, max_queue_time=OWN_DEADLINE_S)
        chat = Answer(server, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "max_queue_time": OWN_DEADLINE_S})
        for waiting in (stream, chat):
            waiting.start()
        deadline = time.monotonic() + 10
        while httpx.get(server.url("/load")).json()["server_load"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(OWN_DEADLINE_S + 0.2)
    finally:
        os.kill(_engine_core_pid(server), signal.SIGCONT)
    stream.join(30)
    chat.join(30)
    assert stream.status == 503, stream.events
    assert chat.response is not None and chat.response.status_code == 503, chat.response
    for error, headers in ((json.loads(stream.events[0])["error"], stream.headers),
                           (chat.response.json()["error"], chat.response.headers)):
        assert error["code"] == "queue_timeout" and error["type"] == "server_error", error
        assert f"over the limit of {OWN_DEADLINE_S:g} s (the request's max_queue_time)" \
            in error["message"], error
        waited = float(re.search(r"waited ([\d.]+) s", error["message"]).group(1))
        assert waited < MAX_QUEUE_TIME_S, error  # refused before the server's limit
        assert 1 <= int(headers["retry-after"]) <= 60
    running.join(120)
    assert running.status == 200 and running.completion_tokens == 1200
    assert _sample(server, "gateway_requests_rejected_total",
                   'reason="queue_timeout"') == timeouts_before + 2


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("value", [b"0", b"-1", b"NaN", b"Infinity", b'"1"', b"true",
                                   b"[1]"])
def test_a_bad_max_queue_time_is_a_400_naming_it(server, path, value):
    head = b'{"prompt": "Hi"' if path == "/v1/completions" else \
        b'{"messages": [{"role": "user", "content": "Hi"}]'
    response = httpx.post(server.url(path), content=head + b', "max_queue_time": ' + value
                          + b', "max_tokens": 2}', headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_queue_time" or "max_queue_time" in error["message"], error


@pytest.mark.parametrize("value", [30, 0.5])
def test_a_max_queue_time_that_is_not_reached_is_honoured_silently(server, value):
    response = httpx.post(server.url("/v1/completions"), json={
        "prompt": "Hi", "max_tokens": 2, "max_queue_time": value}, timeout=60)
    assert response.status_code == 200, response.text
    assert "x-ignored-fields" not in response.headers  # a field of the server, not ignored
