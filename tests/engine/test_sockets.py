"""The engine core's routing between several front ends (gateway.engine.sockets), over
real ZMQ sockets in one process: each front end gets its own requests' outputs and the
scheduler stats; only front end 0 gets the whole iteration stats (the others their own
finished requests), each share stamped with the sending engine's data-parallel index; a
request id another front end has in flight is refused to the one that sent it."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from gateway.engine.sockets import FrontEnds
from gateway.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishedRequestStats,
    IterationStats,
    SchedulerStats,
)
from gateway.sampling_params import SamplingParams

ENCODER = msgspec.msgpack.Encoder()
STATS = SchedulerStats(num_running_reqs=2, num_waiting_reqs=0, kv_cache_usage=0.5,
                       num_free_blocks=1, num_total_blocks=2)
FINISHED = FinishedRequestStats("from-1", "length", 2, 1, 0.1, 0.0, 0.0, 0.1, 0.1)
ITERATION = IterationStats(3, 2, [], [], [FINISHED])


@pytest.fixture
def wired(tmp_path):
    """(FrontEnds, [(input PUSH, output PULL)] of two front ends)."""
    context = zmq.Context()
    clients = []
    for index in range(2):
        push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        push.bind(f"ipc://{tmp_path}/in-{index}")
        pull.bind(f"ipc://{tmp_path}/out-{index}")
        clients.append((push, pull))
    front_ends = FrontEnds(context, [f"ipc://{tmp_path}/in-{i}" for i in range(2)],
                           [f"ipc://{tmp_path}/out-{i}" for i in range(2)], 1000)
    yield front_ends, clients
    context.destroy(linger=0)


def _request(request_id: str) -> bytes:
    return ENCODER.encode(EngineCoreRequest(request_id, [1, 2], SamplingParams(max_tokens=2),
                                            time.time()))


def _receive(front_ends: FrontEnds, count: int) -> list:
    messages: list = []
    deadline = time.monotonic() + 5
    while len(messages) < count and time.monotonic() < deadline:
        front_ends.poller.poll(100)
        messages.extend(front_ends.receive())
    return messages


def _send(front_ends: FrontEnds, outputs: list[EngineCoreOutput], engine_index: int = 0
          ) -> None:
    batch = EngineCoreOutputs(outputs, time.time(), STATS, ITERATION, engine_index)
    assert front_ends.send(batch, ENCODER.encode, lambda socket, data: socket.send(data) or True)


def _batch(pull: zmq.Socket) -> EngineCoreOutputs:
    assert pull.poll(5000)
    return msgspec.msgpack.decode(pull.recv(), type=EngineCoreOutputs)


def test_each_front_end_gets_its_own_outputs_and_only_front_end_0_all_iteration_stats(wired):
    front_ends, clients = wired
    clients[0][0].send(_request("from-0"))
    clients[1][0].send(_request("from-1"))
    assert {m.request_id for m in _receive(front_ends, 2)} == {"from-0", "from-1"}
    _send(front_ends, [EngineCoreOutput("from-0", [5]), EngineCoreOutput("from-1", [6], "length")],
          engine_index=1)
    first, second = _batch(clients[0][1]), _batch(clients[1][1])
    assert first.engine_index == second.engine_index == 1  # data parallel: engine 1's
    assert [(o.request_id, o.new_token_ids) for o in first.outputs] == [("from-0", [5])]
    assert [(o.request_id, o.new_token_ids) for o in second.outputs] == [("from-1", [6])]
    assert first.scheduler_stats == second.scheduler_stats == STATS
    assert first.iteration_stats == ITERATION
    assert second.iteration_stats == IterationStats(0, 0, [], [], [FINISHED])  # its own


def test_a_request_id_in_flight_on_another_front_end_is_refused_to_its_sender(wired):
    front_ends, clients = wired
    clients[0][0].send(_request("same"))
    (admitted,) = _receive(front_ends, 1)
    clients[1][0].send(_request("same"))
    (refusal,) = _receive(front_ends, 1)
    assert isinstance(admitted, EngineCoreRequest)
    assert isinstance(refusal, EngineCoreOutput) and refusal.finish_reason == "error"
    _send(front_ends, [refusal, EngineCoreOutput("same", [7])])
    assert [o.finish_reason for o in _batch(clients[1][1]).outputs] == ["error"]
    assert [o.new_token_ids for o in _batch(clients[0][1]).outputs] == [[7]]
