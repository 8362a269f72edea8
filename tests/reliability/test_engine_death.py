"""End to end: the engine-core process is SIGKILLed while streaming and non-streaming
requests are in flight. Every request ends with an error within 2 s, /health answers 503,
the front end then exits non-zero by itself, and no child process is left.

The server of this module dies in its one test, so it is not shared.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.frontend.conftest import tiny_server
from tests.server import descendant_pids, is_alive, poll_status

pytestmark = pytest.mark.e2e

LONG = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}
ERROR_WITHIN_S = 2.0
EXIT_WITHIN_S = 15.0


def _engine_core_pid(server) -> int:
    """The engine core: the server's child that is a Python multiprocessing process."""
    children = [pid for pid in descendant_pids(server.process.pid)
                if _parent(pid) == server.process.pid]
    cores = [pid for pid in children if b"spawn_main" in _cmdline(pid)]
    assert len(cores) == 1, (children, [_cmdline(p) for p in children])
    return cores[0]


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def _streaming(url: str, started: threading.Event, outcome: dict) -> None:
    try:
        with httpx.Client(timeout=30) as client, client.stream(
                "POST", url, json={**LONG, "stream": True}) as response:
            outcome["status"] = response.status_code
            events = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    started.set()
            outcome["events"] = events
    except httpx.HTTPError as exc:
        outcome["transport_error"] = repr(exc)
    outcome["ended_at"] = time.monotonic()


def _whole(url: str, outcome: dict) -> None:
    try:
        response = httpx.post(url, json=LONG, timeout=30)
        outcome["status"] = response.status_code
        outcome["body"] = response.json()
    except httpx.HTTPError as exc:
        outcome["transport_error"] = repr(exc)
    outcome["ended_at"] = time.monotonic()


def test_engine_death_fails_requests_and_stops_the_server(tiny_model, tmp_path):
    server = tiny_server(tiny_model, log_path=tmp_path / "server.log").start()
    try:
        url = server.url("/v1/completions")
        core = _engine_core_pid(server)
        children = descendant_pids(server.process.pid)
        started = [threading.Event() for _ in range(3)]
        streams = [{} for _ in started]
        wholes = [{} for _ in range(3)]
        threads = [threading.Thread(target=_streaming, args=(url, event, outcome))
                   for event, outcome in zip(started, streams)]
        threads += [threading.Thread(target=_whole, args=(url, outcome)) for outcome in wholes]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(60), server.log_tail()
        time.sleep(0.2)  # the non-streaming ones are generating too by now

        os.kill(core, signal.SIGKILL)
        killed_at = time.monotonic()
        health = poll_status(server.url("/health"), 503, ERROR_WITHIN_S)
        assert health is not None and health.status_code == 503
        assert health.json()["error"]["code"] == "engine_dead"
        for thread in threads:
            thread.join(timeout=ERROR_WITHIN_S + 5)
            assert not thread.is_alive(), "a request is still open after the engine died"

        for outcome in streams:
            assert outcome.get("status") == 200, outcome
            assert outcome["ended_at"] - killed_at < ERROR_WITHIN_S, outcome
            assert "transport_error" not in outcome, outcome  # ended, not dropped
            assert outcome["events"][-1] == "[DONE]"
            assert '"error"' in outcome["events"][-2] and "engine_dead" in outcome["events"][-2]
        for outcome in wholes:
            assert outcome["ended_at"] - killed_at < ERROR_WITHIN_S, outcome
            assert outcome.get("status") == 503, outcome
            assert outcome["body"]["error"]["code"] == "engine_dead"

        code = server.wait_exit(EXIT_WITHIN_S)
        assert code != 0, server.log_tail()
        time.sleep(0.5)
        assert not [pid for pid in children if is_alive(pid)]
    finally:
        server.stop()
    assert not server.leftover_pids
