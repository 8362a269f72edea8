"""--async-scheduling in the engine core, driven in-process on the tiny random model: every
request's tokens and finish equal those of the synchronous engine (greedy and seeded rows,
stop tokens, max_tokens, aborts mid-stream, preemption, structured outputs), the KV cache
is all free at the end, and the scheduler really runs while a step is in flight."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from gateway.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from gateway.engine.core import EngineCore
from gateway.messages import EngineCoreRequest
from gateway.sampling_params import SamplingParams
from gateway.structured_outputs_params import StructuredOutputsParams

# About 40 blocks of 16 tokens: the long batch below preempts, the others fit.
_KV_BUDGET_GIB = 0.0006


def _config(model: str, async_scheduling: bool) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model, dtype="float32"),
        cache=CacheConfig(kv_cache_memory_gib=_KV_BUDGET_GIB),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256,
                                  async_scheduling=async_scheduling))


@pytest.fixture(scope="module")
def cores(tiny_llama) -> Iterator[dict[bool, EngineCore]]:
    engines = {flag: EngineCore(_config(str(tiny_llama), flag)) for flag in (False, True)}
    yield engines
    for engine in engines.values():
        engine.shutdown()


Results = dict[str, tuple[list[int], str | None]]


def _run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]],
         abort_after: dict[str, int] | None = None) -> tuple[Results, int]:
    """Run the requests together to their ends: ({id: (tokens, finish)}, preemptions).
    `abort_after`: abort a request once it has that many tokens."""
    for request_id, (prompt, params) in requests.items():
        assert core.add_request(EngineCoreRequest(request_id, prompt, params,
                                                  time.time())) is None
    results: Results = {rid: ([], None) for rid in requests}
    num_preemptions, started = 0, time.monotonic()
    while core.has_work() and time.monotonic() - started < 60:
        batch = core.step()
        if batch.scheduler_stats is not None:
            num_preemptions += batch.scheduler_stats.num_preemptions
        for output in batch.outputs:
            tokens, _ = results[output.request_id]
            tokens += output.new_token_ids
            results[output.request_id] = (tokens, output.finish_reason)
        for request_id, count in (abort_after or {}).items():
            tokens, finish = results[request_id]
            if finish is None and len(tokens) >= count:
                core.abort_requests([request_id])
                results[request_id] = (tokens, "abort")
    assert not core.has_work()
    kv_cache = core.scheduler.kv_cache
    assert kv_cache.num_free_blocks == kv_cache.num_blocks  # nothing left held
    return results, num_preemptions


def _both(cores: dict[bool, EngineCore], make: Callable[[], dict], **kwargs) -> tuple:
    (sync, sync_preempted), (overlapped, async_preempted) = (
        _run(cores[flag], make(), **kwargs) for flag in (False, True))
    assert overlapped == sync
    return sync, sync_preempted, async_preempted


def _greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def test_concurrent_greedy_and_seeded_rows_match_the_synchronous_engine(cores, monkeypatch):
    def make():
        return {f"g{i}": (list(range(5 + i, 12 + 3 * i)), _greedy(6 + 5 * i))
                for i in range(5)} | {
            f"s{i}": ([7, 8, 9, i + 3], SamplingParams(temperature=0.9, top_p=0.9, seed=i,
                                                       max_tokens=20, ignore_eos=True))
            for i in range(3)}
    sampled = _count_sampled(cores[True], monkeypatch)
    results, _, _ = _both(cores, make)
    assert [len(results[f"g{i}"][0]) for i in range(5)] == [6, 11, 16, 21, 26]
    # A row at max_tokens is not scheduled again: no token is sampled to be dropped.
    assert sampled == {rid: len(tokens) for rid, (tokens, _) in results.items()}
    assert {finish for _, finish in results.values()} == {"length"}


def _count_sampled(core: EngineCore, monkeypatch) -> dict[str, int]:
    """{request id: tokens the worker sampled for it}, from now on."""
    worker = core.executor.worker  # type: ignore[attr-defined]
    counts: dict[str, int] = {}
    execute = worker.execute_model

    def counting_execute(scheduler_output):
        output = execute(scheduler_output)
        for request_id in output.req_ids:
            counts[request_id] = counts.get(request_id, 0) + 1
        return output
    monkeypatch.setattr(worker, "execute_model", counting_execute)
    return counts


def test_a_stop_token_ends_a_row_whose_next_step_was_already_scheduled(cores, monkeypatch):
    # The free-running tokens of each prompt, then a stop token taken from the middle.
    prompts = {f"r{i}": [11 + i, 40, 2 * i + 5] for i in range(4)}
    free, _ = _run(cores[False], {rid: (p, _greedy(16)) for rid, p in prompts.items()})
    stops = {rid: free[rid][0][3 + i] for i, rid in enumerate(prompts)}

    def make():
        return {rid: (p, _greedy(16, stop_token_ids=[stops[rid]]))
                for rid, p in prompts.items()}
    sampled = _count_sampled(cores[True], monkeypatch)
    results, _, _ = _both(cores, make)
    assert all(finish == "stop" for _, finish in results.values())
    # The step behind each stop sampled one more token, dropped.
    assert {rid: sampled[rid] - len(results[rid][0]) for rid in prompts} == dict.fromkeys(
        prompts, 1)
    assert [len(tokens) for tokens, _ in results.values()] == [
        free[rid][0].index(stops[rid]) + 1 for rid in prompts]


def test_an_abort_mid_stream_drops_the_token_in_flight_and_frees_its_blocks(cores,
                                                                           monkeypatch):
    def make():
        return {f"a{i}": ([3 + i, 9, 27], _greedy(30, ignore_eos=True)) for i in range(3)}
    sampled = _count_sampled(cores[True], monkeypatch)
    results, _, _ = _both(cores, make, abort_after={"a1": 5})
    assert sampled["a1"] == 6  # the token in flight at the abort, dropped
    assert len(results["a1"][0]) == 5 and results["a1"][1] == "abort"
    assert [len(results[rid][0]) for rid in ("a0", "a2")] == [30, 30]


def test_preemption_under_a_small_kv_cache_gives_the_same_tokens(cores):
    def make():
        return {f"p{i}": (list(range(20 + i, 60 + i)), _greedy(120, ignore_eos=True))
                for i in range(8)}
    results, sync_preempted, async_preempted = _both(cores, make)
    assert sync_preempted and async_preempted
    assert all(len(tokens) == 120 for tokens, _ in results.values())


def test_structured_rows_wait_for_their_token_and_match(cores, monkeypatch):
    def make():
        return {
            "json": ([5, 6, 7], _greedy(40, structured_outputs=StructuredOutputsParams(
                json='{"type": "object", "properties": {"a": {"type": "integer"}}, '
                     '"required": ["a"], "additionalProperties": false}'))),
            "choice": ([8, 9], _greedy(20, structured_outputs=StructuredOutputsParams(
                choice=["yes", "no", "maybe"]))),
            "free": ([8, 9, 10], _greedy(25, ignore_eos=True)),
        }
    sampled = _count_sampled(cores[True], monkeypatch)
    results, _, _ = _both(cores, make)
    # A grammar row never runs ahead of its token, so it never samples one to drop.
    assert sampled["json"] == len(results["json"][0])
    assert sampled["choice"] == len(results["choice"][0])
    assert results["json"][1] == "stop" and results["choice"][1] == "stop"
    assert len(results["free"][0]) == 25


def test_the_scheduler_runs_while_a_step_is_in_flight(cores, monkeypatch):
    core = cores[True]
    worker = core.executor.worker  # type: ignore[attr-defined]
    step_spans: list[tuple[float, float]] = []
    schedule_times: list[float] = []
    execute, schedule = worker.execute_model, core.scheduler.schedule

    def slow_execute(scheduler_output):
        started = time.monotonic()
        time.sleep(0.02)
        output = execute(scheduler_output)
        step_spans.append((started, time.monotonic()))
        return output

    def timed_schedule():
        schedule_times.append(time.monotonic())
        assert threading.current_thread() is threading.main_thread()
        return schedule()

    monkeypatch.setattr(worker, "execute_model", slow_execute)
    monkeypatch.setattr(core.scheduler, "schedule", timed_schedule)
    _run(core, {"o": ([4, 5, 6], _greedy(8, ignore_eos=True))})
    overlapped = [t for t in schedule_times
                  if any(start < t < end for start, end in step_spans)]
    assert len(overlapped) >= 6  # every decode step was scheduled during the one before


def test_a_pooling_model_ignores_the_flag_by_name(tmp_path, caplog):
    from tests.tiny_model import build_tiny_bert

    config = _config(str(build_tiny_bert(tmp_path / "bert")), True)
    config.scheduler.max_num_batched_tokens = 512  # an encoder reads a prompt whole
    core = EngineCore(config)
    try:
        assert not core.config.scheduler.async_scheduling
        assert "--async-scheduling is ignored" in caplog.text
    finally:
        core.shutdown()
