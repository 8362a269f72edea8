"""Pooling requests in the scheduler: the whole prompt in one step, no KV cache, done
with the runner's vector (an encoder model has no cache: zero blocks)."""

from __future__ import annotations

import numpy as np

from gateway.config import SchedulerConfig
from gateway.engine.kv_cache_manager import KVCacheManager
from gateway.engine.request import Request
from gateway.engine.scheduler import Scheduler
from gateway.messages import EngineCoreRequest, ModelRunnerOutput
from gateway.pooling_params import PoolingParams
from gateway.sampling_params import SamplingParams


def make_scheduler(budget=64, max_num_seqs=8):
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
                     KVCacheManager(0, 16), 128, [])


def add(scheduler, rid, prompt_len):
    request = Request(EngineCoreRequest(rid, list(range(1, 1 + prompt_len)), SamplingParams(),
                                        0.0, PoolingParams()), scheduler.max_model_len)
    scheduler.add_request(request)
    return request


def vector(value):
    return np.full(4, value, dtype=np.float32).tobytes()


def test_pooling_requests_run_whole_in_one_step_without_kv_blocks():
    s = make_scheduler()
    add(s, "a", 10)
    add(s, "b", 30)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 10, "b": 30}
    assert [r.block_ids for r in out.scheduled_new_reqs] == [[], []]
    assert all(r.pooling_params == PoolingParams() for r in out.scheduled_new_reqs)
    results = s.update_from_output(out, ModelRunnerOutput(
        req_ids=[], sampled_token_ids=[], pooler_outputs={"a": vector(1.0), "b": vector(2.0)}))
    assert [(r.request_id, r.finish_reason, r.new_token_ids) for r in results] == [
        ("a", "stop", []), ("b", "stop", [])]
    assert np.frombuffer(results[1].pooling_output, dtype=np.float32).tolist() == [2.0] * 4
    assert not s.has_requests()
    assert s.schedule().finished_req_ids == ["a", "b"]


def test_a_pooling_prompt_is_never_chunked_it_waits_for_the_next_step():
    s = make_scheduler(budget=40)
    add(s, "a", 30)
    add(s, "b", 20)  # does not fit the 10 tokens left
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 30}
    s.update_from_output(out, ModelRunnerOutput(req_ids=[], sampled_token_ids=[],
                                                pooler_outputs={"a": vector(1.0)}))
    assert s.schedule().num_scheduled_tokens == {"b": 20}


def test_a_pooling_request_the_runner_left_out_fails_instead_of_running_again():
    s = make_scheduler()
    add(s, "a", 5)
    out = s.schedule()
    results = s.update_from_output(out, ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
    assert [(r.request_id, r.finish_reason, r.error_kind) for r in results] == [
        ("a", "error", "internal")]
    assert not s.has_requests()


def test_pooled_prompts_count_as_prompt_tokens_in_the_stats():
    s = make_scheduler()
    add(s, "a", 7)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(req_ids=[], sampled_token_ids=[],
                                                pooler_outputs={"a": vector(0.5)}))
    stats = s.take_iteration_stats()
    assert stats.num_prompt_tokens == 7 and stats.num_generation_tokens == 0
    assert [(f.request_id, f.finish_reason, f.num_prompt_tokens)
            for f in stats.finished_requests] == [("a", "stop", 7)]
