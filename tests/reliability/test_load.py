"""End to end: the CI short form of the load run (bench/bench_load.py is the long form).

One real `gateway serve` of the tiny model with the example plugins (summarize,
server_info) pip-installed and allowlisted; 200 requests at concurrency 64 over the driver's
fixed mix (tests/reliability/load.py: completions and chat, streamed and whole, /tokenize,
GET /v1/server-info, GET /metrics). Every request is answered whole: sent = answered, all
200, every stream ends with [DONE] and its usage matches the tokens it carried, and the
server's own success counter went up once per generating request.

Also: a keep-alive connection left idle past the idle expiry of common clients (httpx and
the openai SDK drop theirs after 5 s) is still served. When the server's keep-alive timeout
equalled the client's, a client could reuse a connection at the instant the server closed
it, and that request was lost with no answer (about 1 in 20,000 requests of the long run).
"""

from __future__ import annotations

import asyncio
import re
import socket
import time

import pytest

from tests.frontend.conftest import EXAMPLE_PLUGINS, SERVED_NAME, tiny_server
from tests.reliability.conftest import metric
from tests.reliability.load import MIX, run_load

pytestmark = pytest.mark.e2e

REQUESTS = 200
CONCURRENCY = 64
MAX_TOKENS = 8
COMMON_CLIENT_IDLE_EXPIRY_S = 5.0  # httpx's and the openai SDK's keepalive_expiry


@pytest.fixture(scope="module")
def server(tiny_model, example_plugins_site, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "load-server.log"
    with tiny_server(tiny_model, roots=(example_plugins_site,), log_path=log,
                     VLLM_PLUGINS=",".join(EXAMPLE_PLUGINS)) as server:
        yield server
    assert server.process.returncode == 0, server.log_tail()


def _finished_requests(server) -> float:
    """vllm:request_success_total summed over its finish reasons."""
    import httpx
    text = httpx.get(server.url("/metrics"), timeout=30).text
    pattern = re.compile(r'^vllm:request_success_total\{[^}]*model_name="'
                         + re.escape(SERVED_NAME) + r'"[^}]*\}\s+(\S+)$', re.MULTILINE)
    return sum(float(value) for value in pattern.findall(text))


def test_short_load_run_answers_every_request_whole(server):
    finished_before = _finished_requests(server)
    result = asyncio.run(run_load(server.url(), SERVED_NAME, REQUESTS, CONCURRENCY,
                                  max_tokens=MAX_TOKENS))
    assert result.faults == [], "\n".join(result.faults[:20])
    assert result.sent == result.answered == REQUESTS
    assert dict(result.statuses) == {200: REQUESTS}
    generating = sum(1 for index in range(REQUESTS) if MIX[index % len(MIX)].generates)
    assert result.generated == generating
    assert result.generated_tokens == generating * MAX_TOKENS
    assert _finished_requests(server) - finished_before == generating


def test_server_is_idle_and_clean_after_the_load(server):
    import httpx
    text = httpx.get(server.url("/metrics"), timeout=30).text
    assert metric(text, "vllm:num_requests_running", SERVED_NAME) == 0
    assert metric(text, "vllm:num_requests_waiting", SERVED_NAME) == 0
    assert "Traceback" not in server.log_text(), server.log_tail()


def _get(sock: socket.socket, path: str) -> bytes:
    """Send one HTTP/1.1 GET on `sock` and read its whole (Content-Length) response."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: gateway\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data  # the server closed the connection
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?im)^content-length:\s*(\d+)", head)[1])  # type: ignore[index]
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return head


def test_keep_alive_outlasts_common_client_idle_expiry(server):
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        assert _get(sock, "/health").startswith(b"HTTP/1.1 200")
        time.sleep(COMMON_CLIENT_IDLE_EXPIRY_S + 1.0)
        second = _get(sock, "/health")
    assert second.startswith(b"HTTP/1.1 200"), (
        f"the server closed a connection idle {COMMON_CLIENT_IDLE_EXPIRY_S + 1.0} s: {second!r}")
