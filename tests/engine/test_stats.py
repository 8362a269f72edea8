"""Iteration stats measured by the scheduler as it steps (gateway/engine/stats.py)."""

from __future__ import annotations

import time

import msgspec
import pytest

from gateway.config import SchedulerConfig
from gateway.engine.kv_cache_manager import KVCacheManager
from gateway.engine.request import Request
from gateway.engine.scheduler import Scheduler
from gateway.messages import (
    AbortRequests,
    EngineCoreInput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ModelRunnerOutput,
    SchedulerStats,
)
from gateway.sampling_params import SamplingParams
from tests.engine.test_scheduler import EOS, run_step


def make_scheduler(log_stats=True, **config):
    return Scheduler(SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 64,
                                        **config}),
                     KVCacheManager(64, 4), 256, [EOS], log_stats=log_stats)


def add(scheduler, rid, prompt_len, arrival=None, **params):
    params.setdefault("max_tokens", 8)
    request = EngineCoreRequest(rid, list(range(10, 10 + prompt_len)), SamplingParams(**params),
                                time.time() if arrival is None else arrival)
    scheduler.add_request(Request(request, scheduler.max_model_len))


def steps(scheduler, count, token=7):
    for _ in range(count):
        run_step(scheduler, token)
    return scheduler.take_iteration_stats()


def test_first_token_counts_the_prompt_and_later_tokens_give_inter_token_times():
    s = make_scheduler()
    add(s, "a", 5, max_tokens=3)
    add(s, "b", 2, max_tokens=3)
    first = steps(s, 1)
    assert (first.num_prompt_tokens, first.num_generation_tokens) == (7, 2)
    assert len(first.time_to_first_tokens_iter) == 2 and not first.inter_token_latencies_iter
    second = steps(s, 1)
    assert (second.num_prompt_tokens, second.num_generation_tokens) == (0, 2)
    assert len(second.inter_token_latencies_iter) == 2 and not second.time_to_first_tokens_iter
    assert all(t >= 0 for t in first.time_to_first_tokens_iter
               + second.inter_token_latencies_iter)


def test_a_chunked_prompt_gets_its_first_token_once_the_whole_prompt_is_in():
    s = make_scheduler(max_num_batched_tokens=8)
    add(s, "long", 20, max_tokens=2)
    assert steps(s, 2) is None  # 16 of 20 prompt tokens computed; nothing sampled
    stats = steps(s, 1)
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (20, 1)


def test_time_to_first_token_is_measured_from_the_front_ends_arrival_time():
    s = make_scheduler()
    add(s, "late", 3, arrival=time.time() - 2.0)
    (ttft,) = steps(s, 1).time_to_first_tokens_iter
    assert 2.0 <= ttft < 3.0


def test_a_finished_request_reports_its_reason_tokens_and_times():
    s = make_scheduler()
    add(s, "r", 4, max_tokens=3, ignore_eos=True)
    stats = steps(s, 3)
    (done,) = stats.finished_requests
    assert (done.request_id, done.finish_reason) == ("r", "length")
    assert (done.num_prompt_tokens, done.num_generation_tokens) == (4, 3)
    assert done.max_tokens_param == 3
    assert done.e2e_latency >= done.inference_time >= done.decode_time >= 0
    assert done.queued_time >= 0 and done.prefill_time >= 0
    assert done.e2e_latency == pytest.approx(done.queued_time + done.inference_time)


def test_eos_finishes_as_stop():
    s = make_scheduler()
    add(s, "r", 2)
    run_step(s, 5)
    (done,) = steps(s, 1, token=EOS).finished_requests
    assert done.finish_reason == "stop" and done.num_generation_tokens == 2


@pytest.mark.parametrize("reason", ["abort", "stop"])
def test_an_aborted_request_is_recorded_with_the_reason_the_front_end_gave(reason):
    s = make_scheduler()
    add(s, "running", 2)
    add(s, "never-ran", 2)
    s.config.max_num_seqs = 1
    run_step(s)
    s.take_iteration_stats()
    s.abort_requests(["running", "never-ran"], reason)
    finished = {r.request_id: r for r in s.take_iteration_stats().finished_requests}
    assert finished["running"].finish_reason == reason
    assert finished["running"].num_generation_tokens == 1
    assert finished["never-ran"].prefill_time == 0.0
    assert finished["never-ran"].num_generation_tokens == 0


def test_a_worker_error_finishes_as_error():
    s = make_scheduler()
    add(s, "b", 2)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(req_ids=[], sampled_token_ids=[],
                                                errors={"b": "processor exploded"}))
    assert [r.finish_reason for r in s.take_iteration_stats().finished_requests] == ["error"]


def test_without_log_stats_nothing_is_collected():
    s = make_scheduler(log_stats=False)
    add(s, "r", 2, max_tokens=1)
    assert steps(s, 1) is None and s.stats_collector is None


def test_stats_travel_in_the_outputs_message_and_an_old_abort_still_decodes():
    s = make_scheduler()
    add(s, "r", 3, max_tokens=1)
    run_step(s)
    outputs = EngineCoreOutputs([], 1.0, SchedulerStats(0, 0, 0.0, 64, 64),
                                s.take_iteration_stats())
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(outputs), type=EngineCoreOutputs)
    assert decoded == outputs and decoded.iteration_stats.finished_requests[0].request_id == "r"
    legacy = msgspec.msgpack.encode(["abort", ["x"]])
    assert msgspec.msgpack.decode(legacy, type=EngineCoreInput) == AbortRequests(["x"], "abort")
