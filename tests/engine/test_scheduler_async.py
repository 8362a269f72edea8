"""The scheduler under --async-scheduling, driven in-process: steps marked in flight,
placeholders, and the outputs of the oldest step landing while the next one is scheduled."""

from __future__ import annotations

from gateway.config import SchedulerConfig
from gateway.engine.kv_cache_manager import KVCacheManager
from gateway.engine.request import RequestStatus
from gateway.engine.scheduler import Scheduler
from gateway.messages import ModelRunnerOutput
from gateway.structured_outputs_params import StructuredOutputsParams
from tests.engine.test_scheduler import add

EOS = 2


def make_scheduler(num_blocks=64, block_size=4):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                     async_scheduling=True),
                     KVCacheManager(num_blocks, block_size), 256, [EOS])


def submit(scheduler):
    out = scheduler.schedule()
    if out.num_scheduled_tokens:
        scheduler.mark_in_flight(out)
    return out


def land(scheduler, out, tokens):
    return scheduler.update_from_output(out, ModelRunnerOutput(
        req_ids=list(tokens), sampled_token_ids=list(tokens.values())))


def test_a_row_runs_again_with_a_placeholder_while_its_step_is_in_flight():
    s = make_scheduler()
    a = add(s, "a", 5)
    first = submit(s)
    assert (a.num_computed_tokens, a.num_output_placeholders) == (5, 1)
    second = submit(s)
    assert second.num_scheduled_tokens == {"a": 1}
    assert second.scheduled_cached_reqs[0].num_computed_tokens == 5  # the placeholder's slot
    assert a.num_output_placeholders == 2
    results = land(s, first, {"a": 7})
    assert [(r.request_id, r.new_token_ids) for r in results] == [("a", [7])]
    assert (a.output_token_ids, a.num_output_placeholders) == ([7], 1)


def test_a_token_landing_after_its_row_finished_is_dropped_and_the_blocks_are_free():
    s = make_scheduler(num_blocks=8)
    add(s, "a", 5)
    first, second = submit(s), submit(s)
    assert [r.finish_reason for r in land(s, first, {"a": EOS})] == ["stop"]
    assert s.kv_cache.num_free_blocks == 8
    assert land(s, second, {"a": 7}) == []
    assert not s.has_requests() and submit(s).finished_req_ids == ["a"]


def test_a_request_preempted_while_its_token_was_in_flight_keeps_the_token():
    s = make_scheduler(num_blocks=3)
    add(s, "a", 4)
    b = add(s, "b", 4)
    first = submit(s)  # both prompts: two of the three blocks
    second = submit(s)  # a's decode takes the last block; b, out of blocks, preempts itself
    assert second.num_scheduled_tokens == {"a": 1} and b.status is RequestStatus.WAITING
    land(s, first, {"a": 7, "b": 9})
    assert (b.output_token_ids, b.num_output_placeholders) == ([9], 0)
    land(s, second, {"a": 8})
    s.abort_requests(["a"])
    third = submit(s)
    assert [(r.req_id, r.output_token_ids) for r in third.scheduled_new_reqs] == [("b", [9])]


def test_rows_that_their_token_ends_or_constrains_wait_for_it():
    s = make_scheduler()
    add(s, "one", 3, max_tokens=1)
    add(s, "grammar", 3, structured_outputs=StructuredOutputsParams(choice=["x", "y"]))
    add(s, "free", 3)
    submit(s)
    assert submit(s).num_scheduled_tokens == {"free": 1}


def test_blocks_enter_the_prefix_cache_once_their_step_is_done():
    s = make_scheduler()
    a = add(s, "a", 8)
    first = submit(s)
    second = submit(s)
    assert a.num_cached_blocks == 0  # computed by a step still in flight
    land(s, first, {"a": 7})
    assert a.num_cached_blocks == 2
    land(s, second, {"a": 7})
    assert a.num_cached_blocks == 2  # position 8's block is not full


def test_a_preempted_request_restarts_only_after_its_token_landed():
    s = make_scheduler(num_blocks=3)
    add(s, "a", 4)
    add(s, "b", 4)
    first = submit(s)
    submit(s)  # b preempts itself
    s.abort_requests(["a"])
    assert s.schedule().num_scheduled_tokens == {}  # blocks free, but b's token in flight
    land(s, first, {"a": 7, "b": 9})
    assert [(r.req_id, r.output_token_ids) for r in submit(s).scheduled_new_reqs] == [
        ("b", [9])]
