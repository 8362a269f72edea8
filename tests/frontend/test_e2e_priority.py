"""The request field `priority` through real servers: refused by name under the default
policy (fcfs), and under `--scheduling-policy priority` the queue is served lower value
first (one running sequence, so the others wait in the engine's queue)."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import pytest

from tests.frontend.conftest import SERVED_NAME, tiny_server
from tests.metrics.helpers import metrics_text, value

pytestmark = pytest.mark.e2e


def _completion(priority: int, max_tokens: int = 4) -> dict:
    return {"model": SERVED_NAME, "prompt": "Hello, world!", "max_tokens": max_tokens,
            "ignore_eos": True, "priority": priority}


def _wait_until_queued(server, count: int, limit: float = 60.0) -> None:
    """Until /metrics shows `count` requests waiting in the engine (however loaded the
    machine is); a failure if they never get there."""
    deadline = time.monotonic() + limit
    waiting = -1.0
    with httpx.Client(base_url=server.url(""), timeout=30) as client:
        while time.monotonic() < deadline:
            waiting = value(metrics_text(client), "vllm:num_requests_waiting")
            if waiting >= count:
                return
            time.sleep(0.05)
    raise AssertionError(f"{waiting} requests waiting after {limit} s, expected {count}")


def test_priority_is_refused_by_name_without_the_priority_policy(tiny_model):
    with tiny_server(tiny_model) as server:
        response = httpx.post(server.url("/v1/completions"), json=_completion(1), timeout=60)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "priority" and "--scheduling-policy priority" in \
            error["message"]
        assert httpx.post(server.url("/v1/completions"), json=_completion(0),
                          timeout=60).status_code == 200


def test_the_queue_is_served_by_priority(tiny_model):
    with tiny_server(tiny_model, "--scheduling-policy", "priority",
                     "--max-num-seqs", "1") as server:
        finished: list[int] = []
        lock = threading.Lock()

        def send(priority: int) -> None:
            # Each runs alone for 24 steps, so a late client thread cannot swap two.
            response = httpx.post(server.url("/v1/completions"),
                                  json=_completion(priority, 24), timeout=120)
            assert response.status_code == 200, response.text
            with lock:
                finished.append(priority)

        with concurrent.futures.ThreadPoolExecutor(5) as pool, httpx.stream(
                "POST", server.url("/v1/completions"), timeout=120,
                json={**_completion(100, 2000), "stream": True}) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")  # it runs, alone
            rest = [pool.submit(send, priority) for priority in (7, -3, 5, 0, 2)]
            _wait_until_queued(server, 5)  # they wait in the engine's queue
            assert not finished
            first.close()  # the client leaves: the engine takes the queue in order
            for future in rest:
                future.result()
        assert finished == [-3, 0, 2, 5, 7]
        chat = httpx.post(server.url("/v1/chat/completions"), timeout=60, json={
            "model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2, "priority": -1})
        assert chat.status_code == 200, chat.text
