"""EngineLiveness: a stall needs pending requests and no step for the threshold; the reason
tells a frozen core (no heartbeat) from a live one stuck at a step; progress recovers."""

from __future__ import annotations

import time

import pytest

from gateway.frontend.engine_client.liveness import EngineLiveness
from gateway.messages import EngineHeartbeat

THRESHOLD_S = 0.05


def _beat(num_steps: int) -> EngineHeartbeat:
    return EngineHeartbeat(num_steps, 1, time.time())


@pytest.mark.parametrize(("beats", "reason"), [
    (0, "sent no heartbeat"), (1, "sent no heartbeat"), (3, "alive but stuck at step 7")])
def test_pending_requests_and_no_step_for_the_threshold_is_a_stall(beats, reason):
    liveness = EngineLiveness(lambda: 2, THRESHOLD_S)
    liveness.on_heartbeat(_beat(7))
    for _ in range(beats):
        liveness.on_heartbeat(_beat(7))
    liveness.check()
    assert not liveness.is_stalled
    time.sleep(THRESHOLD_S * 1.5)
    liveness.check()
    assert liveness.is_stalled and reason in liveness.stalled_reason
    assert "2 requests pending" in liveness.stalled_reason
    liveness.on_heartbeat(_beat(8))  # the counter moved: a step completed
    assert not liveness.is_stalled and liveness.num_stalls == 1


def test_an_idle_engine_is_never_stalled_and_time_starts_with_work():
    pending = [0]
    liveness = EngineLiveness(lambda: pending[0], THRESHOLD_S)
    time.sleep(THRESHOLD_S * 1.5)
    liveness.check()
    assert not liveness.is_stalled
    pending[0] = 1
    liveness.check()  # work just arrived: not late yet
    assert not liveness.is_stalled
    time.sleep(THRESHOLD_S * 1.5)
    liveness.check()
    assert liveness.is_stalled
    pending[0] = 0  # every client gave up: nothing waits on the engine any more
    liveness.check()
    assert not liveness.is_stalled


def test_requests_the_engine_holds_for_another_front_end_count_as_pending():
    """With several API servers, one with no request of its own still sees the engine's."""
    liveness = EngineLiveness(lambda: 0, THRESHOLD_S)
    liveness.on_heartbeat(EngineHeartbeat(4, 3, time.time()))  # 3 requests, another's
    time.sleep(THRESHOLD_S * 1.5)
    liveness.check()
    assert liveness.is_stalled and "3 requests pending" in liveness.stalled_reason
    liveness.on_heartbeat(EngineHeartbeat(4, 0, time.time()))  # they ended elsewhere
    liveness.check()
    assert not liveness.is_stalled


def test_each_check_asks_the_client_to_expire_what_arrived_since_the_last_step():
    """The engine client's hook gets the time of the last completed step at each check
    while requests are pending; the count it returns is in the stall's reason."""
    calls: list[float] = []

    def expire_waiting(progress_at: float) -> int:
        calls.append(progress_at)
        return 2

    pending = [0]
    liveness = EngineLiveness(lambda: pending[0], THRESHOLD_S)
    liveness.expire_waiting = expire_waiting
    liveness.check()
    assert calls == []  # nothing pending: nothing to expire
    pending[0] = 3
    before = time.monotonic()
    liveness.check()
    time.sleep(THRESHOLD_S * 1.5)
    liveness.check()
    assert len(calls) == 2 and calls[0] == calls[1] <= before  # no step since
    assert liveness.is_stalled
    assert "3 requests pending (2 of them arrived since)" in liveness.stalled_reason
    liveness.on_heartbeat(_beat(1))  # a step: the next check counts from it
    liveness.check()
    assert calls[-1] > before and not liveness.is_stalled
