"""Ray kept on loopback: while a Ray-backed server answers, no process of the server's tree
(its engine core, the local cluster it started, the rank actors), nor of the tests' own
head, holds a socket bound to or connected to an address other than loopback. The check
itself is tested first: it sees a wildcard listener and a loopback one for what they are."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.executor.ray_head import cluster_pids
from tests.executor.test_data_parallel_server import COMPARED
from tests.frontend.conftest import tiny_server
from tests.server import ServerProcess, descendant_pids
from tests.sockets import inet_sockets, off_loopback

pytestmark = pytest.mark.e2e

PROMPT = [1, 5, 9, 33, 70, 12]


def test_the_check_flags_a_wildcard_listener_and_passes_a_loopback_pair():
    with socket.create_server(("0.0.0.0", 0)) as wildcard, \
            socket.create_server(("127.0.0.1", 0)) as listener, \
            socket.create_connection(listener.getsockname()) as client:
        accepted, _ = listener.accept()
        with accepted:
            sockets = inet_sockets({os.getpid()})
            wildcard_port = wildcard.getsockname()[1]
            ports = {int(sock.local.rpartition(":")[2]) for sock in sockets}
            assert {wildcard_port, listener.getsockname()[1],
                    client.getsockname()[1]} <= ports
            flagged = off_loopback(sockets)
    assert [sock.local for sock in flagged] == [f"0.0.0.0:{wildcard_port}"]
    assert flagged[0].is_listening


def _assert_on_loopback_mid_stream(server: ServerProcess, extra_pids: set[int]) -> None:
    assert server.process is not None
    body = {"prompt": PROMPT, "max_tokens": 64, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=120) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # generating
        pids = {server.process.pid} | descendant_pids(server.process.pid) | extra_pids
        sockets = inet_sockets(pids)
        assert any(sock.is_listening and sock.local.endswith(f":{server.port}")
                   for sock in sockets)  # the check sees the server's own listener
        assert off_loopback(sockets) == []
        assert any(line == "data: [DONE]" for line in lines)


def test_a_server_on_the_tests_ray_head_stays_on_loopback(tiny_model: Path,
                                                         ray_head: tuple[str, Path]):
    address, temp_dir = ray_head
    with tiny_server(tiny_model, *COMPARED, "-tp", "2", "--distributed-executor-backend",
                     "ray", RAY_ADDRESS=address, RAY_USAGE_STATS_ENABLED="0") as server:
        _assert_on_loopback_mid_stream(server, cluster_pids(temp_dir))


@pytest.fixture
def own_cluster_server(tiny_model: Path) -> Iterator[ServerProcess]:
    """A server that starts its own local Ray cluster (RAY_ADDRESS=local: not the package's
    head, which Ray would otherwise find and join)."""
    with tiny_server(tiny_model, *COMPARED, "-tp", "2", "--distributed-executor-backend",
                     "ray", RAY_ADDRESS="local", RAY_USAGE_STATS_ENABLED="0") as server:
        yield server


def test_the_local_cluster_the_gateway_starts_stays_on_loopback(own_cluster_server):
    _assert_on_loopback_mid_stream(own_cluster_server, set())
