"""Worker thread placement on CPUs: how many threads, which cores, vLLM's variables."""

from __future__ import annotations

import pytest

from gateway.worker.cpu_threads import ThreadPlan, plan_threads


@pytest.mark.parametrize(("allowed", "workers", "rank", "variables", "expected"), [
    # By default nothing is reserved; several workers split the cores.
    ([0, 1], 1, 0, {}, ThreadPlan(2, (0, 1))),
    ([0, 1, 2, 3], 2, 1, {}, ThreadPlan(2, (2, 3))),
    # Reserved cores are the first ones; the worker is pinned to the rest.
    ([0, 1], 1, 0, {"reserved": "1"}, ThreadPlan(1, (1,))),
    ([4, 5, 6, 7], 2, 0, {"reserved": "2"}, ThreadPlan(1, (6,))),
    # nobind: the same count, nothing pinned; a list: exactly those cores, per rank.
    ([0, 1], 1, 0, {"bind": "nobind", "reserved": "1"}, ThreadPlan(1, None)),
    ([0, 1, 2, 3], 2, 1, {"bind": "0-1|2,3"}, ThreadPlan(2, (2, 3))),
], ids=["default", "2-workers", "reserve-1", "reserve-2", "nobind", "explicit-list"])
def test_plan_reserves_and_pins_cores(allowed: list[int], workers: int, rank: int,
                                      variables: dict[str, str], expected: ThreadPlan) -> None:
    assert plan_threads(allowed, workers, rank, **variables) == expected


def test_a_worker_in_a_users_own_process_is_not_pinned() -> None:
    assert plan_threads([0, 1], 1, 0, placement=False) == ThreadPlan(2, None)


@pytest.mark.parametrize(("variables", "message"), [
    ({"reserved": "two"}, "VLLM_CPU_NUM_OF_RESERVED_CPU='two' is not a whole number"),
    ({"reserved": "2"}, "VLLM_CPU_NUM_OF_RESERVED_CPU=2 must leave at least one"),
    ({"bind": "0-x"}, "VLLM_CPU_OMP_THREADS_BIND: '0-x' is not a core list"),
    ({"bind": "0"}, "names cores for 1 rank"),
], ids=["not-a-number", "all-reserved", "bad-list", "too-few-ranks"])
def test_bad_placement_variables_are_named(variables: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_threads([0, 1], 2 if "rank" in message else 1, 1 if "rank" in message else 0,
                     **variables)
