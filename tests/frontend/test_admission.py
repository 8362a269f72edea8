"""Admission: the in-flight cap refuses the request beyond it with a counted 503 error, and
Retry-After follows the drain rate (bounded; a default when nothing finished lately)."""

from __future__ import annotations

import pytest

from gateway.frontend.engine_client.admission import (
    MAX_RETRY_AFTER_S,
    UNKNOWN_RATE_RETRY_AFTER_S,
    Admission,
    RequestRejectedError,
)


def test_the_request_beyond_the_cap_is_refused_and_counted():
    inflight = [2]
    seen = []
    admission = Admission(lambda: inflight[0], max_num_queued_reqs=3)
    admission.rejection_listeners.append(seen.append)
    admission.check()  # 2 in flight, a third fits
    inflight[0] = 3
    with pytest.raises(RequestRejectedError) as refused:
        admission.check()
    assert refused.value.code == "queue_full" and "--max-num-queued-reqs 3" in str(refused.value)
    assert admission.num_rejected == {"queue_full": 1} and seen == ["queue_full"]


def test_a_fan_out_is_admitted_whole_or_not_at_all():
    admission = Admission(lambda: 2, max_num_queued_reqs=10)
    admission.check(8)  # 2 + 8 fit
    with pytest.raises(RequestRejectedError) as refused:
        admission.check(9)
    assert "this request needs 9 (its prompts x n)" in str(refused.value)
    assert "--max-num-queued-reqs 10" in str(refused.value)


def test_no_cap_admits_everything():
    Admission(lambda: 10_000).check()


@pytest.mark.parametrize(("finished", "num_ahead", "retry_after"), [
    (0, 5, UNKNOWN_RATE_RETRY_AFTER_S),  # no rate to estimate from
    (10, 5, 1),  # 10 finished within a second: 5 ahead drain at once
    (2, 8, 4),  # 2 a second, 8 ahead
    (1, 10_000, MAX_RETRY_AFTER_S),  # bounded
])
def test_retry_after_is_the_time_the_queue_ahead_needs_to_drain(finished, num_ahead,
                                                                retry_after):
    admission = Admission(lambda: 0)
    if finished:
        admission.note_finished(finished)
    assert admission.retry_after_s(num_ahead) == retry_after
