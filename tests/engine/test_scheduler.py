"""The scheduler, driven in-process with the step results a worker would return."""

from __future__ import annotations

import pytest

from gateway.config import SchedulerConfig
from gateway.engine.kv_cache_manager import KVCacheManager
from gateway.engine.request import Request
from gateway.engine.scheduler import Scheduler
from gateway.messages import EngineCoreRequest, ModelRunnerOutput, SchedulerOutput
from gateway.sampling_params import SamplingParams

EOS = 2


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=256,
                   enable_caching=True, prefill_cap=None):
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     max_num_prefill_tokens=prefill_cap),
                     KVCacheManager(num_blocks, block_size, enable_caching), max_model_len,
                     [EOS])


def add(scheduler, rid, prompt_len, **params):
    params.setdefault("max_tokens", 8)
    request = Request(EngineCoreRequest(rid, list(range(10, 10 + prompt_len)),
                                        SamplingParams(**params), 0.0), scheduler.max_model_len)
    scheduler.add_request(request)
    return request


def run_step(scheduler, token=7, tokens=None):
    """One step where every request that finished its prompt samples `token`."""
    out = scheduler.schedule()
    req_ids = []
    for rid, n in out.num_scheduled_tokens.items():
        request = scheduler.requests[rid]
        if request.num_computed_tokens + n >= request.num_tokens:
            req_ids.append(rid)
    sampled = [tokens.get(r, token) if tokens else token for r in req_ids]
    results = scheduler.update_from_output(out, ModelRunnerOutput(req_ids=req_ids,
                                                                  sampled_token_ids=sampled))
    return out, results


def test_new_requests_join_and_finished_ones_leave_between_steps():
    s = make_scheduler()
    add(s, "a", 5, max_tokens=2)
    out, _ = run_step(s)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a"]
    add(s, "b", 3, max_tokens=5)
    out, results = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}
    assert [(r.request_id, r.finish_reason) for r in results] == [("a", "length"), ("b", None)]
    out, _ = run_step(s)
    assert out.finished_req_ids == ["a"] and list(out.num_scheduled_tokens) == ["b"]


def test_token_budget_chunks_a_long_prompt():
    s = make_scheduler(budget=16)
    add(s, "long", 40)
    chunks = [run_step(s)[0].num_scheduled_tokens["long"] for _ in range(3)]
    assert chunks == [16, 16, 8]
    assert s.requests["long"].output_token_ids == [7]  # sampled only after the last chunk


def test_running_cap_makes_requests_wait():
    s = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        add(s, rid, 2)
    out, _ = run_step(s)
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert [r.request_id for r in s.waiting] == ["c"]


def test_full_cache_makes_requests_wait_never_dropped():
    s = make_scheduler(num_blocks=4, block_size=4)
    add(s, "a", 12, max_tokens=3)
    add(s, "b", 8, max_tokens=1)
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["a"]  # b does not fit yet
    while "a" in s.requests:
        run_step(s)
    out, results = run_step(s)
    assert list(out.num_scheduled_tokens) == ["b"]


@pytest.mark.parametrize("enable_caching", [False, True])
def test_decode_out_of_blocks_preempts_the_latest_by_recompute(enable_caching):
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=16,  # the cache holds 16
                       enable_caching=enable_caching)
    add(s, "old", 4, max_tokens=20)
    add(s, "new", 4, max_tokens=20)
    for _ in range(6):
        run_step(s)
    assert s.waiting and s.waiting[0].request_id == "new"
    new = s.requests["new"]
    assert new.block_ids == [] and new.num_computed_tokens == 0 and new.output_token_ids
    while "old" in s.requests:
        out, _ = run_step(s)
    generated_before = list(new.output_token_ids)
    out, _ = run_step(s)
    resumed = out.scheduled_new_reqs[0]
    assert resumed.req_id == "new" and resumed.output_token_ids == generated_before
    # It recomputes all it had, less the leading blocks still cached (old's were the same).
    assert (resumed.num_computed_tokens > 0) is enable_caching
    assert resumed.num_computed_tokens % 4 == 0
    assert out.num_scheduled_tokens["new"] == (4 + len(generated_before)
                                               - resumed.num_computed_tokens)


def test_abort_frees_the_cache_at_any_point():
    s = make_scheduler(num_blocks=8, block_size=4)
    add(s, "a", 10)
    add(s, "w", 3)
    run_step(s)
    assert s.kv_cache.num_free_blocks < 8
    assert sorted(s.abort_requests(["a", "w", "unknown"])) == ["a", "w"]
    assert s.kv_cache.num_free_blocks == 8 and not s.has_requests()
    assert sorted(s.schedule().finished_req_ids) == ["a", "w"]


@pytest.mark.parametrize("params, tokens, reason, stop_reason", [
    ({}, [5, EOS], "stop", None),
    ({"ignore_eos": True, "max_tokens": 2}, [5, EOS], "length", None),
    ({"stop_token_ids": [9]}, [5, 9], "stop", 9),
    ({"min_tokens": 3, "max_tokens": 5}, [EOS, EOS, EOS], "stop", None),
    ({"max_tokens": 2}, [5, 6], "length", None),
])
def test_finish_reasons(params, tokens, reason, stop_reason):
    s = make_scheduler()
    add(s, "r", 3, **params)
    results = []
    for token in tokens:
        results += run_step(s, token)[1]
    assert results[-1].finish_reason == reason and results[-1].stop_reason == stop_reason
    assert all(r.finish_reason is None for r in results[:-1])


def test_context_length_ends_a_request():
    s = make_scheduler(max_model_len=6)
    add(s, "r", 4, max_tokens=None)
    results = run_step(s)[1] + run_step(s)[1]
    assert [r.finish_reason for r in results] == [None, "length"]


def test_stats_describe_the_queue_and_cache():
    s = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=1)
    add(s, "a", 8)
    add(s, "b", 2)
    run_step(s)
    stats = s.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(0.2)  # 8 prompt tokens: 2 of 10 blocks


def test_worker_errors_fail_only_their_request():
    s = make_scheduler()
    add(s, "a", 2)
    add(s, "b", 2)
    out = s.schedule()
    results = s.update_from_output(out, ModelRunnerOutput(
        req_ids=["a"], sampled_token_ids=[5], errors={"b": "processor exploded"}))
    assert [(r.request_id, r.finish_reason) for r in results] == [("a", None), ("b", "error")]
    assert results[1].error_kind == "internal" and "b" not in s.requests


def test_empty_schedule_when_nothing_waits():
    s = make_scheduler()
    assert s.schedule() == SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=[],
                                           num_scheduled_tokens={}, finished_req_ids=[])


def test_a_shared_prefix_starts_the_new_request_after_its_cached_blocks():
    s = make_scheduler(block_size=4)
    s.add_request(Request(EngineCoreRequest("a", list(range(10, 21)), SamplingParams(), 0.0),
                          256))
    run_step(s)  # a's 11 prompt tokens: two full blocks cached after the step
    s.add_request(Request(EngineCoreRequest("b", list(range(10, 19)) + [5, 6], SamplingParams(),
                                            0.0), 256))
    out, _ = run_step(s)
    new = out.scheduled_new_reqs[0]
    assert new.req_id == "b" and new.num_computed_tokens == 8
    assert new.block_ids[:2] == s.requests["a"].block_ids[:2]
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}
    stats = s.make_stats().prefix_cache_stats
    assert stats is not None and (stats.requests, stats.queries, stats.hits) == (2, 22, 8)


def test_decode_rows_keep_flowing_while_a_long_prompt_prefills():
    s = make_scheduler(budget=16, num_blocks=64)
    for rid in ("d1", "d2"):
        add(s, rid, 3, max_tokens=20)
    run_step(s)  # both prompts: now decoding
    add(s, "long", 60)
    chunks = []
    while not s.requests["long"].output_token_ids:
        out, _ = run_step(s)
        assert out.num_scheduled_tokens["d1"] == out.num_scheduled_tokens["d2"] == 1
        chunks.append(out.num_scheduled_tokens["long"])
    assert chunks == [14, 14, 14, 14, 4]  # the budget less the two decode rows


def test_the_prefill_cap_spreads_a_burst_of_prompts_over_steps_and_spares_decode_rows():
    s = make_scheduler(budget=64, num_blocks=128, prefill_cap=12, enable_caching=False)
    for rid in ("a", "b", "c", "d"):
        add(s, rid, 8, max_tokens=20)
    steps = [run_step(s)[0].num_scheduled_tokens for _ in range(4)]
    # 12 prompt tokens a step, first come first served; a chunk of "b" waits its turn.
    assert steps[0] == {"a": 8, "b": 4}
    assert steps[1] == {"a": 1, "b": 4, "c": 8}
    assert steps[2] == {"a": 1, "b": 1, "c": 1, "d": 8}
    assert steps[3] == {"a": 1, "b": 1, "c": 1, "d": 1}


def test_a_request_alone_gets_the_whole_budget_despite_the_prefill_cap():
    s = make_scheduler(budget=32, prefill_cap=8)
    add(s, "alone", 48)
    assert run_step(s)[0].num_scheduled_tokens == {"alone": 32}
    add(s, "next", 4)  # now not alone: the cap holds for both prompts, in their order
    assert run_step(s)[0].num_scheduled_tokens == {"alone": 8}
    assert run_step(s)[0].num_scheduled_tokens == {"alone": 8}
    assert run_step(s)[0].num_scheduled_tokens == {"alone": 1, "next": 4}


def test_queue_deadline_refuses_only_requests_that_never_ran():
    import time
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64,
                                  max_queue_time=5.0),
                  KVCacheManager(64, 4, True), 256, [EOS])
    now = time.time()
    for rid, arrived in (("running", now - 1), ("late", now - 10), ("fresh", now)):
        s.add_request(Request(EngineCoreRequest(rid, [10, 11, 12], SamplingParams(max_tokens=8),
                                                arrived), 256))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["running"]  # the cap of one runs the first
    expired = s.take_expired()
    assert [(o.request_id, o.finish_reason, o.error_kind) for o in expired] == [
        ("late", "error", "queue_timeout")]
    assert "--max-queue-time" in expired[0].error
    assert "late" not in s.requests and [r.request_id for r in s.waiting] == ["fresh"]
    s.requests["running"].arrival_time = now - 60  # past the deadline, but it runs
    run_step(s)
    assert "running" in s.requests and s.take_expired() == []  # admitted: never dropped


def test_a_fan_out_sequence_sent_after_its_siblings_started_is_never_refused_by_the_deadline():
    import time
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64,
                                  max_queue_time=5.0),
                  KVCacheManager(64, 4, True), 256, [EOS])
    long_ago = time.time() - 60
    for rid, started in (("running", False), ("sibling", True), ("stranger", False)):
        s.add_request(Request(EngineCoreRequest(rid, [10, 11, 12], SamplingParams(max_tokens=8),
                                                long_ago, sibling_started=started), 256))
    run_step(s)
    assert [o.request_id for o in s.take_expired()] == ["stranger"]
    assert [r.request_id for r in s.waiting] == ["sibling"]  # it waits its turn


@pytest.mark.parametrize(("server_s", "own_s", "expired", "whose"), [
    (None, 2.0, True, "the request's max_queue_time"),  # its own limit, the server's none
    (5.0, 2.0, True, "the request's max_queue_time"),  # its own, shorter than the server's
    (5.0, 60.0, False, None),  # a longer one of its own does not lift the server's
    (None, 60.0, False, None),
])
def test_a_request_may_shorten_its_own_queue_deadline(server_s, own_s, expired, whose):
    import time
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64,
                                  max_queue_time=server_s),
                  KVCacheManager(64, 4, True), 256, [EOS])
    now = time.time()
    for rid, params in (("running", SamplingParams(max_tokens=8)),
                        ("waiting", SamplingParams(max_tokens=8, max_queue_time=own_s))):
        s.add_request(Request(EngineCoreRequest(rid, [10, 11, 12], params, now - 3), 256))
    run_step(s)
    refused = s.take_expired()
    assert [o.request_id for o in refused] == (["waiting"] if expired else [])
    if expired:
        assert f"over the limit of {own_s:g} s ({whose})" in refused[0].error


def test_a_late_request_that_can_start_now_starts():
    import time
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                  max_queue_time=5.0),
                  KVCacheManager(64, 4, True), 256, [EOS])
    params = SamplingParams(max_tokens=8, max_queue_time=0.5)
    s.add_request(Request(EngineCoreRequest("late", [10, 11, 12], params,
                                            time.time() - 10), 256))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["late"] and s.take_expired() == []


def test_a_draft_models_lookahead_never_takes_a_block_a_later_request_needs():
    """Lookahead slots come from the blocks left once the step is scheduled: "a" (which
    may draft) goes first, yet "b" (which may not) gets the last free block for its token,
    and "a" proposes nothing after this step instead of "b" being preempted."""
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                  KVCacheManager(3, 4), 256, [EOS], num_lookahead_tokens=4)
    add(s, "a", 3).can_speculate = True
    add(s, "b", 4)
    out, _ = run_step(s)
    assert out.draft_req_ids == ["a"]
    assert len(out.scheduled_new_reqs[0].block_ids) == 2  # the worker writes its lookahead
    assert len(s.requests["a"].block_ids) == 1  # released after the step
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.draft_req_ids == []
    assert s.make_stats().num_preemptions == 0
