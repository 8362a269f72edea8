"""Prefix caching through the real engine core and worker (tiny fp32 model, greedy): the
same tokens with the cache on as with it off, over mixed batches that share prefixes and do
not, with chunked prefill, preemption by recompute (a small KV pool) and aborts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gateway.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from gateway.engine.core import EngineCore
from gateway.messages import EngineCoreRequest
from gateway.sampling_params import SamplingParams

BLOCK_SIZE = 4
BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * BLOCK_SIZE * 4  # K and V, 2 layers, 2 kv heads, dim 16, fp32


def make_workload() -> tuple[dict[int, list[tuple[str, str, list[int]]]], set[str]]:
    """step -> [("add", id, prompt) | ("abort", id, [])], and the ids that are aborted."""
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 430) for _ in range(n)]

    prefix = tokens(22)  # five full blocks and two tokens
    lone = tokens(17)
    events: dict[int, list[tuple[str, str, list[int]]]] = {
        0: [("add", "a", prefix + tokens(5)), ("add", "b", prefix + tokens(9)),
            ("add", "c", lone)],
        2: [("add", "d", prefix + tokens(3)), ("add", "e", list(prefix))],  # e: whole hit
        4: [("abort", "b", [])],
        6: [("add", "f", lone + tokens(6)), ("add", "g", prefix[:10] + tokens(10)),
            ("add", "h", prefix[:8])],  # h: a prompt of exactly two cached blocks
        9: [("abort", "f", [])],
        12: [("add", "i", prefix + tokens(2)), ("add", "j", tokens(30))],
    }
    return events, {"b", "f"}


def run_engine(model: Path, enable_prefix_caching: bool, num_blocks: int,
               prefill_cap: int | None = None) -> tuple[dict[str, list[int]], int, int]:
    """Drive the workload step by step; the tokens of each request, the cache hits (in
    tokens) and the preemptions."""
    engine = EngineCore(EngineConfig(
        model=ModelConfig(model=str(model), dtype="float32"),
        cache=CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory_gib=num_blocks
                          * BYTES_PER_BLOCK / 1024**3,
                          enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                  max_num_prefill_tokens=prefill_cap)))
    assert engine.executor.num_kv_blocks == num_blocks
    # On the CPU no cap given means the CPU's default; a cap given is kept.
    assert engine.scheduler.config.max_num_prefill_tokens == (prefill_cap or 256)
    events, _ = make_workload()
    tokens: dict[str, list[int]] = {}
    hits = preemptions = 0
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    try:
        for step in range(1000):
            for action, rid, prompt in events.get(step, []):
                if action == "add":
                    tokens[rid] = []
                    assert engine.add_request(EngineCoreRequest(rid, prompt, params, 0.0)) is None
                else:
                    engine.abort_requests([rid])
            if not engine.has_work() and step > max(events):
                break
            outputs = engine.step()
            for output in outputs.outputs:
                assert output.error is None, output.error
                tokens[output.request_id] += output.new_token_ids
            stats = outputs.scheduler_stats
            assert stats is not None
            preemptions += stats.num_preemptions
            assert (stats.prefix_cache_stats is not None) is enable_prefix_caching
            if stats.prefix_cache_stats is not None:
                hits += stats.prefix_cache_stats.hits
        assert not engine.has_work()
    finally:
        engine.shutdown()
    return tokens, hits, preemptions


@pytest.mark.parametrize("num_blocks, preempts", [(200, False), (24, True)])
def test_outputs_with_the_cache_equal_outputs_without_it(tiny_llama: Path, num_blocks: int,
                                                         preempts: bool) -> None:
    off, no_hits, preemptions_off = run_engine(tiny_llama, False, num_blocks)
    on, hits, preemptions_on = run_engine(tiny_llama, True, num_blocks)
    assert no_hits == 0 and hits > 0
    assert (preemptions_off > 0) is preempts
    _, aborted = make_workload()
    for rid in off:
        if rid in aborted:  # stopped at the same step, not at the same token: a prefix
            shorter, longer = sorted((off[rid], on[rid]), key=len)
            assert longer[:len(shorter)] == shorter, rid
        else:
            assert len(off[rid]) == 14 and on[rid] == off[rid], rid


def test_a_small_prefill_cap_changes_no_token(tiny_llama: Path) -> None:
    # 5 prompt tokens a step: prompts split over many steps, decode rows in between.
    uncapped, _, _ = run_engine(tiny_llama, True, 200, prefill_cap=32)
    capped, _, _ = run_engine(tiny_llama, True, 200, prefill_cap=5)
    _, aborted = make_workload()
    for rid in uncapped:
        if rid not in aborted:
            assert len(capped[rid]) == 14 and capped[rid] == uncapped[rid], rid
