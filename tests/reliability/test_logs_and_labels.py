"""End to end: what clients send cannot grow the metrics or put a secret in the log. One
real `gateway serve` with an API key, the access log on, and an endpoint plugin (a real
installed distribution) whose route logs the request's headers, as careless plugins do.

- 20,000 requests with made-up HTTP methods to the plugin's route (pipelined over a few
  keep-alive connections) are counted under method="other"; /metrics stays under 100 KB.
- `api_key`/`key` query parameters, Authorization headers (right or wrong key) and the
  server's key never reach the log; the access log shows "[redacted]" in their place.
- With two Authorization headers, the first decides.
"""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from gateway.plugins import ENDPOINT_PLUGINS_GROUP
from tests.metrics.helpers import samples
from tests.plugin_dists import subprocess_env, write_dist
from tests.server import ServerProcess

pytestmark = pytest.mark.e2e

KEY = "sk-logs-4d1c9e0b77"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROUTE = "/v1/header-dump"
NUM_MADE_UP = 20_000
NUM_CONNECTIONS = 4
BATCH = 250
PLUGIN_SOURCE = '''
import logging

from fastapi import APIRouter, FastAPI, Request


class HeaderDump:
    name = "header_dump"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        router = APIRouter()

        @router.get("/v1/header-dump")
        async def dump(request: Request):
            logging.getLogger("header_dump").warning("headers: %s", dict(request.headers))
            return {"ok": True}

        app.include_router(router)

    async def init_state(self, engine_client, state, args):
        pass


def factory():
    return HeaderDump()
'''


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    root = write_dist(tmp_path_factory.mktemp("header-dump"), "gw-header-dump",
                      {ENDPOINT_PLUGINS_GROUP: {"header_dump": "gw_header_dump:factory"}},
                      {"gw_header_dump": PLUGIN_SOURCE})
    env = subprocess_env(root, VLLM_PLUGINS="header_dump")
    env.pop("VLLM_API_KEY", None)
    log = tmp_path_factory.mktemp("logs") / "logs-server.log"
    flags = [str(tiny_model), "--served-model-name", "tiny", "--max-model-len", "512",
             "--kv-cache-memory", "64MiB", "--api-key", KEY]  # access log on
    with ServerProcess(flags, env=env, log_path=log) as server:
        yield server
    assert server.process.returncode == 0, server.log_tail()


def _pipeline(port: int, methods: list[str], answered: list[int]) -> None:
    """Send one request per method over one connection, `BATCH` at a time, reading every
    response before the next batch; count the responses in `answered`."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for start in range(0, len(methods), BATCH):
            batch = methods[start:start + BATCH]
            sock.sendall(b"".join(
                f"{m} {ROUTE} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n"
                .encode() for m in batch))
            received = b""
            while received.count(b"HTTP/1.1 ") < len(batch):
                data = sock.recv(1 << 16)
                assert data, "the server closed the connection"
                received += data
            answered.append(len(batch))


def test_made_up_methods_are_one_label_value_and_metrics_stay_small(server, http):
    assert http.get(ROUTE, headers=AUTH).status_code == 200
    before = len(http.get("/metrics").content)
    methods = [f"M{i:05d}Q" for i in range(NUM_MADE_UP)]
    share = NUM_MADE_UP // NUM_CONNECTIONS
    answered: list[int] = []
    threads = [threading.Thread(target=_pipeline, args=(
        server.port, methods[i * share:(i + 1) * share], answered))
        for i in range(NUM_CONNECTIONS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert sum(answered) == NUM_MADE_UP

    text = http.get("/metrics").text
    assert len(text) < 100_000, (before, len(text))
    counted = {dict(labels)["method"]: value for (name, labels), value in samples(text).items()
               if name == "gateway_plugin_route_requests_total"}
    assert counted == {"GET": 1, "other": NUM_MADE_UP}


def test_keys_in_query_strings_and_headers_never_reach_the_log(server, http):
    secrets = ["q-secret-api-key-1", "q-secret-key-2", "h-secret-wrong-3", KEY]
    assert http.get(f"/v1/models?api_key={secrets[0]}&limit=1", headers=AUTH).status_code == 200
    assert http.get(f"/v1/models?x=1&key={secrets[1]}", headers=AUTH).status_code == 200
    assert http.get(ROUTE, headers={"Authorization": f"Bearer {secrets[2]}"}).status_code == 401
    assert http.get(ROUTE, headers=AUTH).status_code == 200  # the plugin logs the headers
    log = server.log_text()
    assert "api_key=[redacted]&limit=1" in log and "x=1&key=[redacted]" in log
    assert "'authorization': '[redacted]'" in log
    leaked = [secret for secret in secrets if secret in log]
    assert not leaked, log[-3000:]


@pytest.mark.parametrize(("first", "second", "status"), [
    (KEY, "sk-wrong", 200), ("sk-wrong", KEY, 401)], ids=["right-first", "wrong-first"])
def test_with_two_authorization_headers_the_first_decides(server, first, second, status):
    headers = httpx.Headers([("Authorization", f"Bearer {first}"),
                             ("Authorization", f"Bearer {second}")])
    assert httpx.get(server.url("/v1/models"), headers=headers).status_code == status
