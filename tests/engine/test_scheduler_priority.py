"""`--scheduling-policy priority` (vLLM's semantics): requests start in order of
(priority, arrival), lower first, and with the KV cache full the lowest priority is
preempted first; "fcfs" keeps arrival order and preempts the latest."""

from __future__ import annotations

import pytest

from gateway.config import SchedulerConfig
from gateway.engine.kv_cache_manager import KVCacheManager
from gateway.engine.request import Request
from gateway.engine.scheduler import Scheduler
from gateway.messages import EngineCoreRequest
from gateway.sampling_params import SamplingParams
from tests.engine.test_scheduler import run_step


def _scheduler(policy: str, num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                             policy=policy)
    return Scheduler(config, KVCacheManager(num_blocks, 4, True), 64, [2])


def _add(scheduler: Scheduler, rid: str, priority: int, arrival: float, prompt_len: int = 4,
         max_tokens: int = 3) -> Request:
    request = Request(EngineCoreRequest(
        rid, list(range(10, 10 + prompt_len)),
        SamplingParams(max_tokens=max_tokens, priority=priority), arrival), 64)
    scheduler.add_request(request)
    return request


def _start_order(scheduler: Scheduler) -> list[str]:
    order = []
    while scheduler.has_requests():
        out, _ = run_step(scheduler)
        order += [r.req_id for r in out.scheduled_new_reqs if r.req_id not in order]
    return order


@pytest.mark.parametrize("policy,expected", [("priority", ["b", "d", "c", "a"]),
                                             ("fcfs", ["a", "b", "c", "d"])])
def test_waiting_requests_start_by_priority_then_arrival(policy, expected):
    s = _scheduler(policy, max_num_seqs=1)
    for rid, priority, arrival in [("a", 5, 1.0), ("b", -1, 2.0), ("c", 3, 3.0),
                                   ("d", 3, 2.5) if policy == "priority" else ("d", 0, 4.0)]:
        _add(s, rid, priority if policy == "priority" else 0, arrival)
    assert _start_order(s) == expected


@pytest.mark.parametrize("policy,victim", [("priority", "low"), ("fcfs", "high")])
def test_with_the_kv_cache_full_the_lowest_priority_is_preempted_first(policy, victim):
    s = _scheduler(policy, num_blocks=4)  # 16 tokens of cache for two growing requests
    low = _add(s, "low", 10 if policy == "priority" else 0, 1.0, max_tokens=20)
    high = _add(s, "high", 0, 2.0, max_tokens=20)  # arrived later
    run_step(s)
    assert len(s.running) == 2  # both run: two blocks each for now
    while not s.waiting:
        run_step(s)
    assert [r.request_id for r in s.waiting] == [victim]
    survivor = high if victim == "low" else low
    assert survivor.block_ids and s.running == [survivor]
    assert s.requests[victim].num_computed_tokens == 0 and s.requests[victim].num_preemptions


def test_a_preempted_request_returns_behind_the_higher_priorities_that_wait():
    s = _scheduler("priority", num_blocks=4, max_num_seqs=2)
    _add(s, "low", 9, 1.0, max_tokens=20)
    _add(s, "high", 0, 2.0, max_tokens=20)
    run_step(s)
    _add(s, "mid", 5, 3.0)  # waits: two may run
    while s.requests["low"].num_preemptions == 0:
        run_step(s)
    assert [r.request_id for r in s.waiting] == ["mid", "low"]


@pytest.mark.parametrize("policy,expected", [("priority", {"urgent": 8}),
                                             ("fcfs", {"late": 1, "urgent": 7})])
def test_the_running_batch_is_served_by_priority_when_the_budget_is_short(policy, expected):
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, policy=policy)
    s = Scheduler(config, KVCacheManager(64, 4, False), 64, [2])  # no shared prefix
    _add(s, "late", 1 if policy == "priority" else 0, 1.0, prompt_len=8, max_tokens=20)
    run_step(s)  # late's prompt, alone
    _add(s, "urgent", 0, 2.0, prompt_len=20)
    assert run_step(s)[0].num_scheduled_tokens == {"late": 1, "urgent": 7}
    assert run_step(s)[0].num_scheduled_tokens == expected
