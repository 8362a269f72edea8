"""End to end: requests that fail anywhere (at the Unicode boundary, in validation, in turning
messages into a prompt, in the engine, past the context) leave nothing behind. After 200 failing
requests of each kind, the server's in-flight count (/load), `vllm:num_requests_running`
and the front end's resident memory are back where they were, and it still serves.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.frontend.conftest import SERVED_NAME, tiny_server
from tests.reliability.conftest import metric

pytestmark = pytest.mark.e2e

NUM_EACH = 200
MEMORY_SLACK_BYTES = 24 * 1024 * 1024
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
FAILING = {  # kind -> (path, raw JSON body, status)
    "surrogate-in-xargs": (COMPLETIONS, rb'{"prompt": "Hi", "vllm_xargs": {"k": "\ud800"}}',
                           400),
    "surrogate-in-chat": (CHAT, rb'{"messages": [{"role": "user", "content": "\udc00"}]}',
                          400),
    "megabyte-body": (COMPLETIONS, b'{"prompt": "Hi", "max_tokens": 0, "user": "'
                      + b"x" * 1024 * 1024 + b'"}', 400),
    "deep-xargs": (COMPLETIONS, b'{"prompt": "Hi", "vllm_xargs": ' + b'{"a": ' * 700 + b"1"
                   + b"}" * 700 + b"}", 400),
    "content-part-refused": (CHAT, b'{"messages": [{"role": "user", "content": '
                             b'[{"type": "image_url", "image_url": {"url": "x"}}]}]}', 400),
    "engine-refuses": (COMPLETIONS, b'{"prompt": [1, 99999999], "max_tokens": 2}', 400),
    "past-the-context": (COMPLETIONS, b'{"prompt": [' + b",".join([b"5"] * 2100)
                         + b'], "max_tokens": 2}', 400),
    "streaming-engine-refuses": (COMPLETIONS, b'{"prompt": [1, 99999999], "stream": true}',
                                 400),
}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "error-paths-server.log"
    with tiny_server(tiny_model, log_path=log) as server:
        yield server
    assert server.process.returncode == 0, server.log_tail()


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _state(http) -> tuple[int, float]:
    text = http.get("/metrics").text
    return (http.get("/load").json()["server_load"],
            metric(text, "vllm:num_requests_running", SERVED_NAME))


async def _send_all(base_url: str, path: str, body: bytes, count: int) -> list[int]:
    limits = httpx.Limits(max_connections=16)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
        async def one() -> int:
            response = await client.post(path, content=body,
                                         headers={"Content-Type": "application/json"})
            return response.status_code
        return await asyncio.gather(*(one() for _ in range(count)))


def test_failing_requests_of_every_kind_leave_nothing_behind(server, http):
    for path, body, status in FAILING.values():  # warm-up: caches and pools settle first
        assert set(asyncio.run(_send_all(server.url(), path, body, 20))) == {status}
    assert _state(http) == (0, 0)
    before = _rss_bytes(server.process.pid)
    for kind, (path, body, status) in FAILING.items():
        statuses = asyncio.run(_send_all(server.url(), path, body, NUM_EACH))
        assert set(statuses) == {status}, (kind, sorted(set(statuses)))
        assert _state(http) == (0, 0), kind
    after = _rss_bytes(server.process.pid)
    assert after - before < MEMORY_SLACK_BYTES, (before, after)
    assert "Traceback" not in server.log_text(), server.log_tail()
    ok = http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
