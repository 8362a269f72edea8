"""End to end: the front end is SIGKILLed (nothing of it runs any more: no shutdown, no
cleanup), idle or with 8 streams generating, with one rank in the engine core or two
worker processes. Every process it had started is gone within a few seconds, the engine
core says why in the log, and its IPC folder is removed.

Each server dies in its test, so none is shared.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.frontend.conftest import tiny_server
from tests.server import descendant_pids, is_alive

pytestmark = pytest.mark.e2e

NUM_STREAMS = 8
GONE_WITHIN_S = 4.0  # noticed within 2 s, then at most 1.5 s to stop


def _stream(url: str, started: threading.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    try:
        with httpx.Client(timeout=30) as client, client.stream("POST", url,
                                                                json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    started.set()
    except httpx.HTTPError:
        pass  # the server was killed under it: the point of the test


@pytest.mark.parametrize(("tp", "busy"), [(1, True), (2, True), (2, False)],
                         ids=["one-rank-busy", "two-ranks-busy", "two-ranks-idle"])
def test_killed_front_end_leaves_no_process(tiny_model, tmp_path, tp, busy):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    server = tiny_server(tiny_model, "--tensor-parallel-size", str(tp),
                         log_path=tmp_path / "server.log", TMPDIR=str(tmp)).start()
    try:
        children = descendant_pids(server.process.pid)
        assert len(children) >= 1 + (tp if tp > 1 else 0), children
        assert [p.name for p in tmp.iterdir() if p.name.startswith("gateway-ipc-")]
        threads = []
        if busy:
            started = [threading.Event() for _ in range(NUM_STREAMS)]
            threads = [threading.Thread(target=_stream, daemon=True,
                                        args=(server.url("/v1/completions"), event))
                       for event in started]
            for thread in threads:
                thread.start()
            for event in started:
                assert event.wait(60), server.log_tail()

        os.kill(server.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        server.process.wait(10)
        while time.monotonic() - killed_at < 15 and any(is_alive(p) for p in children):
            time.sleep(0.05)
        gone_after = time.monotonic() - killed_at
        left = [p for p in children if is_alive(p)]
        assert not left, f"{left} still alive {gone_after:.1f} s after:\n{server.log_tail()}"
        assert gone_after < GONE_WITHIN_S, server.log_tail()
        assert "The front end (pid " in server.log_text()
        assert not [p for p in tmp.iterdir() if p.name.startswith("gateway-ipc-")]
        for thread in threads:
            thread.join(10)
            assert not thread.is_alive()
    finally:
        server.stop()
