"""The engine connection's input: messages beyond the socket's high-water mark wait in the
connection's own queue and go out in order, each at a constant cost (pyzmq's list of send
futures made every completed send scan the whole backlog: quadratic)."""

from __future__ import annotations

import asyncio
import os
import time

import zmq
import zmq.asyncio

from gateway.frontend.engine_client.connection import EngineConnection
from gateway.messages import EngineHandshake


class _Process:
    pid, sentinel, exitcode = os.getpid(), -1, None

    def is_alive(self) -> bool:
        return True

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        pass

    def kill(self) -> None:
        pass


async def _send_and_drain(tmp_path, num_messages: int) -> tuple[list[int], float, int]:
    """Send `num_messages` while the reader reads nothing, then read them all: (what was
    read, the seconds the sends and the reads took, the most messages queued)."""
    context = zmq.asyncio.Context()
    push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    push.bind(f"ipc://{tmp_path}/input")
    pull.connect(f"ipc://{tmp_path}/input")
    handshake = EngineHandshake([], 1, 1, 1, [], 1, [], os.getpid())
    connection = EngineConnection(0, handshake, context, push, context.socket(zmq.PULL), None,
                                  None, owned=_Process())
    try:
        started = time.perf_counter()
        for number in range(num_messages):
            connection.send_bytes(b"%d" % number)
        num_queued = len(connection._outbox)
        received = [int(await pull.recv()) for _ in range(num_messages)]
        return received, time.perf_counter() - started, num_queued
    finally:
        context.destroy(linger=0)


def test_a_backlog_is_sent_in_order_at_a_constant_cost_per_message(tmp_path):
    received, small_s, queued = asyncio.run(_send_and_drain(tmp_path, 4_000))
    assert received == list(range(4_000)) and queued > 0  # past the high-water mark
    received, large_s, _ = asyncio.run(_send_and_drain(tmp_path, 16_000))
    assert received == list(range(16_000))
    # Four times the messages: about four times the time (quadratic was sixteen).
    assert large_s < 8 * small_s + 0.5, (small_s, large_s)
