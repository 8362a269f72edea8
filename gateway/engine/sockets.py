"""The engine core's sockets to its front ends (engine-core process), one PULL/PUSH pair per
API-server process (`--api-server-count N`; one pair with a single front end).

A request is owned by the front end whose socket it came in on, and its outputs go back to
that front end alone. Every front end gets every batch (its own outputs, possibly none)
with the scheduler's stats (running, waiting, KV use). The whole engine's iteration stats
go to front end 0, which runs the stat loggers, so a token is counted exactly once; each
other front end gets only the finished-request stats of its own requests (for its tracing
spans), with no token counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgspec
import zmq

from gateway.messages import (
    AbortRequests,
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishedRequestStats,
    IterationStats,
)

STATS_CLIENT = 0  # the front end that receives the iteration stats and runs the stat loggers


class FrontEnds:
    """Sockets to the front ends at `input_addrs[i]` / `output_addrs[i]`, and who owns which
    request (see the module doc). `send_timeout_ms` bounds each blocked send, so that a
    sender can check whether anybody still reads."""

    def __init__(self, context: zmq.Context, input_addrs: list[str], output_addrs: list[str],
                 send_timeout_ms: int) -> None:
        if len(input_addrs) != len(output_addrs) or not input_addrs:
            raise ValueError("one input and one output address per front end")
        self.inputs = [_connect(context, zmq.PULL, addr) for addr in input_addrs]
        self.outputs = [_connect(context, zmq.PUSH, addr) for addr in output_addrs]
        for socket in self.outputs:
            socket.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
            socket.setsockopt(zmq.LINGER, 0)
        self.poller = zmq.Poller()
        for socket in self.inputs:
            self.poller.register(socket, zmq.POLLIN)
        self._owner: dict[str, int] = {}  # request id -> index of the front end that sent it
        self._reply_to: dict[int, int] = {}  # id() of a refusal -> the front end refused
        self._decoder = msgspec.msgpack.Decoder(EngineCoreInput)

    @property
    def num_clients(self) -> int:
        return len(self.outputs)

    def receive(self) -> Iterator[EngineCoreInput | EngineCoreOutput]:
        """Every message waiting now, from every front end (never blocks). A request whose id
        another front end already has in flight is answered with an error output instead."""
        for index, socket in enumerate(self.inputs):
            while True:
                try:
                    message = self._decoder.decode(socket.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                yield self._admit(index, message)

    def _admit(self, index: int, message: EngineCoreInput) -> EngineCoreInput | EngineCoreOutput:
        if isinstance(message, EngineCoreRequest):
            if self._owner.get(message.request_id, index) != index:
                error = EngineCoreOutput(message.request_id, [], "error",
                                         error="request id already in flight on another "
                                         "API server", error_kind="invalid_request")
                self._reply_to[id(error)] = index  # not to the owner of that id
                return error
            self._owner[message.request_id] = index
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                self._owner.pop(request_id, None)  # an aborted request sends no more outputs
        return message

    def send(self, batch: EngineCoreOutputs, encode: Callable[[object], bytes],
             send: Callable[[zmq.Socket, bytes], bool]) -> bool:
        """Send each front end its share of `batch` with `send(socket, data)`; False once one
        of those sends gives up (nobody reads any more)."""
        if self.num_clients == 1:
            self._forget_finished(batch.outputs)
            return send(self.outputs[0], encode(batch))
        shares: list[list[EngineCoreOutput]] = [[] for _ in self.outputs]
        finished = self._finished_shares(batch.iteration_stats)  # before owners are forgotten
        for output in batch.outputs:
            index = self._reply_to.pop(id(output), None)
            if index is None:
                index = self._owner.get(output.request_id, STATS_CLIENT)
                if output.finish_reason is not None:
                    self._owner.pop(output.request_id, None)
            shares[index].append(output)
        for index, socket in enumerate(self.outputs):
            stats = batch.iteration_stats if index == STATS_CLIENT else (
                IterationStats(0, 0, [], [], finished[index]) if finished[index] else None)
            share = EngineCoreOutputs(shares[index], batch.timestamp, batch.scheduler_stats,
                                      stats, batch.engine_index)
            if not send(socket, encode(share)):
                return False
        return True

    def _finished_shares(self, stats: IterationStats | None) -> list[list[FinishedRequestStats]]:
        shares: list[list[FinishedRequestStats]] = [[] for _ in self.outputs]
        for request in stats.finished_requests if stats is not None else ():
            shares[self._owner.get(request.request_id, STATS_CLIENT)].append(request)
        return shares

    def send_to_all(self, data: bytes, send: Callable[[zmq.Socket, bytes], bool]) -> bool:
        """The same bytes to every front end (the handshake)."""
        return all(send(socket, data) for socket in self.outputs)

    def _forget_finished(self, outputs: list[EngineCoreOutput]) -> None:
        for output in outputs:
            if output.finish_reason is not None:
                self._owner.pop(output.request_id, None)

    def close(self, linger_ms: int = 0) -> None:
        for socket in (*self.inputs, *self.outputs):
            socket.close(linger=linger_ms)


def _connect(context: zmq.Context, kind: int, address: str) -> zmq.Socket:
    socket = context.socket(kind)
    socket.connect(address)
    return socket
