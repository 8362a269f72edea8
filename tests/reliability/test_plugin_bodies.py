"""End to end, on a real server of the tiny model with a real installed endpoint plugin:
a plugin route's request body is held to `--max-request-body-bytes` like any other, and a
plugin route of `JSONBodyRoute` (docs/plugins.md) parses a multi-megabyte body without
stalling the event loop, whether FastAPI validates it as a model or the route awaits
`request.json()` itself.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from gateway.plugins import ENDPOINT_PLUGINS_GROUP
from tests.frontend.conftest import tiny_server
from tests.plugin_dists import write_dist
from tests.reliability.test_request_bodies import LOOP_STALL_S, NUM_TOKEN_IDS, _health_while

pytestmark = pytest.mark.e2e

MODULE = "gw_body_plugin"
SOURCE = '''
from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel

from gateway.frontend.http.json_body import JSONBodyRoute


class Ids(BaseModel):
    ids: list[int]


class BodyPlugin:
    name = "body"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        router = APIRouter(route_class=JSONBodyRoute)

        @router.post("/v1/count-ids")
        async def count_ids(body: Ids) -> dict:
            return {"count": len(body.ids)}

        @router.post("/v1/count-raw")
        async def count_raw(request: Request) -> dict:
            return {"count": len((await request.json())["ids"])}

        plain = APIRouter()  # FastAPI's own route class

        @plain.post("/v1/plain")
        async def plain_route(body: dict) -> dict:
            return {"keys": len(body)}

        app.include_router(router)
        app.include_router(plain)

    async def init_state(self, engine_client, state, args) -> None:
        pass


def make():
    return BodyPlugin()
'''
MAX_BODY_BYTES = 12 * 1024 * 1024


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("plugin-site")
    write_dist(root, "gw-body-plugin", {ENDPOINT_PLUGINS_GROUP: {"body": f"{MODULE}:make"}},
               {MODULE: SOURCE})
    log = tmp_path_factory.mktemp("logs") / "plugin-bodies.log"
    with tiny_server(tiny_model, "--event-loop-stall-threshold", str(LOOP_STALL_S),
                     "--max-request-body-bytes", str(MAX_BODY_BYTES), roots=(root,),
                     log_path=log, VLLM_PLUGINS="body") as server:
        yield server
    assert server.process.returncode == 0, server.log_tail()


@pytest.fixture(scope="module")
def huge_ids_body() -> bytes:
    ids = [random.randrange(400) for _ in range(NUM_TOKEN_IDS)]
    return json.dumps({"ids": ids}).encode()


@pytest.mark.parametrize("path", ["/v1/count-ids", "/v1/count-raw"])
def test_a_plugin_route_parses_a_multi_megabyte_body_off_the_loop(server, huge_ids_body,
                                                                  path):
    assert 5_000_000 < len(huge_ids_body) < MAX_BODY_BYTES

    async def send(client):
        return await client.post(path, content=huge_ids_body,
                                 headers={"content-type": "application/json"})

    response, latencies = asyncio.run(_health_while(server, send))
    assert response.status_code == 200, response.text[:300]
    assert response.json() == {"count": NUM_TOKEN_IDS}
    assert len(latencies) >= 5
    assert max(latencies) < LOOP_STALL_S, sorted(latencies)[-5:]
    assert "event loop was blocked" not in server.log_text()


@pytest.mark.parametrize("path", ["/v1/count-ids", "/v1/count-raw", "/v1/plain"])
def test_a_plugin_route_body_over_the_cap_is_a_413(server, path):
    content = b'{"ids": [' + b"1," * (MAX_BODY_BYTES // 2) + b"1]}"
    response = httpx.post(server.url(path), content=content, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413, response.text[:300]
    assert response.json()["error"]["code"] == "request_too_large"


def test_a_plugin_route_body_that_is_not_json_is_a_400_naming_why(server):
    """Past the size parsed on the loop. (A route that awaits `request.json()` gets
    Starlette's JSONDecodeError, as it would without the route class.)"""
    content = b'{"ids": [' + b"1," * 100_000 + b"oops]}"
    response = httpx.post(server.url("/v1/count-ids"), content=content, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text[:300]
    assert response.json()["error"]["code"] == "json_invalid", response.text[:300]
