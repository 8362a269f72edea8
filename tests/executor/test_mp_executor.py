"""The mp executor, with real worker processes joined by real torch.distributed (gloo):
two ranks generate exactly what one rank generates, for every way the model is split; the
ranks agree on the fewest KV blocks any budget holds; a model that cannot be split is
refused at start-up, naming the counts, with no process left behind."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from gateway.config import (
    CacheConfig,
    ConfigurationError,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
)
from gateway.executor.mp import MultiprocExecutor
from gateway.lora_request import LoRARequest
from gateway.messages import CachedRequestData, NewRequestData, SchedulerOutput
from gateway.sampling_params import SamplingParams
from gateway.tokenizer import load_tokenizer
from gateway.worker.worker import Worker
from tests.server import is_alive
from tests.step_driver import StepDriver
from tests.tiny_lora import build_tiny_lora

GREEDY = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
# Sampled rows too: every rank draws the same token only if its sampler state is the same.
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=100, ignore_eos=True)
UNSEEDED = SamplingParams(temperature=1.0, max_tokens=100, ignore_eos=True)
_KV_BUDGET_GIB = 0.004
_GIB = 1024**3


def _config(model: Path | None, ranks: int, max_model_len: int = 512,
            kv_budget_gib: float = _KV_BUDGET_GIB, quantization: str | None = None) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=None if model is None else str(model), dtype="float32",
                          max_model_len=max_model_len, quantization=quantization),
        cache=CacheConfig(kv_cache_memory_gib=kv_budget_gib),
        parallel=ParallelConfig(tensor_parallel_size=ranks))


def _one_rank(config: EngineConfig) -> tuple[Worker, int]:
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    return worker, worker.initialize_kv_cache()


def _generate(executor, num_blocks: int) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    """Three requests of different lengths in one batch: chunked prefill under a small
    token budget, a later arrival, greedy and sampled rows, then decodes."""
    driver = StepDriver(executor, num_blocks)
    driver.add("greedy", list(range(3, 45)), GREEDY)
    driver.add("seeded", [5, 9, 33, 7], SEEDED)
    for _ in range(3):
        driver.step(budget=16)
    driver.add("unseeded", [100, 17], UNSEEDED)
    for _ in range(12):
        driver.step(budget=16)
    return {request.req_id: request.output for request in driver.running}


@pytest.fixture(scope="module")
def executors() -> Iterator:  # type: ignore[type-arg]
    """Two-rank executors by model folder, started once per module."""
    started: dict[Path, MultiprocExecutor] = {}

    def get(model: Path) -> MultiprocExecutor:
        if model not in started:
            started[model] = MultiprocExecutor(_config(model, ranks=2))
        return started[model]

    yield get
    for executor in started.values():
        executor.shutdown()


@pytest.mark.parametrize("model_name", ["tiny_model", "uneven_model"])
def test_two_ranks_generate_what_one_rank_generates(model_name, executors, request):
    model = request.getfixturevalue(model_name)
    executor = executors(model)
    expected = _generate(*_one_rank(_config(model, ranks=1)))
    assert _generate(executor, executor.num_kv_blocks) == expected
    assert all(len(tokens) >= 12 for tokens in expected.values())


def test_two_ranks_run_lora_adapters_as_one_rank_does(uneven_model, tmp_path):
    """A of column-parallel projections whole and B split, row-parallel A split and B
    whole (summed by the all-reduce): the same tokens as one rank, adapters and base mixed."""
    loras = [LoRARequest(lora_name=name, lora_int_id=i + 1, lora_path=str(build_tiny_lora(
        uneven_model, tmp_path / name, rank=4, seed=i + 1)))
        for i, name in enumerate(("a", "b"))]

    def config(ranks: int) -> EngineConfig:
        return msgspec.structs.replace(_config(uneven_model, ranks),
                                       lora=LoRAConfig(max_loras=2, max_lora_rank=4))

    def run(executor, num_blocks: int) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
        driver = StepDriver(executor, num_blocks)
        for req_id, lora in (("a", loras[0]), ("base", None), ("b", loras[1])):
            params = msgspec.structs.replace(GREEDY, lora_request=lora)
            driver.add(req_id, list(range(3, 20)), params)
        for _ in range(8):
            driver.step(budget=64)
        return {request.req_id: request.output for request in driver.running}

    expected = run(*_one_rank(config(1)))
    assert len({tuple(tokens) for tokens in expected.values()}) == 3  # the adapters act
    executor = MultiprocExecutor(config(2))
    try:
        assert run(executor, executor.num_kv_blocks) == expected
    finally:
        executor.shutdown()


def test_the_kv_cache_is_the_fewest_blocks_any_ranks_budget_holds(uneven_model, executors):
    executor = executors(uneven_model)
    # 2 layers, head dim 16, 16-token blocks, float32: rank 0 holds 2 KV heads, rank 1 one.
    per_kv_head = 2 * 2 * 16 * 16 * 4
    budget = int(_KV_BUDGET_GIB * _GIB)
    held = [status.num_kv_blocks for status in executor.ready.statuses]
    assert held == [budget // (2 * per_kv_head), budget // per_kv_head]
    assert executor.num_kv_blocks == held[0]


def test_a_model_with_fewer_kv_heads_than_ranks_is_refused_at_start_up(tiny_model):
    # The tiny model has 4 query heads on 2 KV heads: 3 ranks cannot each hold one.
    with pytest.raises(RuntimeError) as refused:
        MultiprocExecutor(_config(tiny_model, ranks=3))
    message = str(refused.value)
    assert re.match(r"worker ranks 0 \(pid \d+ on .+\), 1 \(pid \d+ on .+\), 2 \(pid \d+ on "
                    r".+\) failed to start: ValueError: The model has 2 key-value heads \(4 "
                    r"query heads\), which cannot be split across 3 tensor-parallel ranks",
                    message), message
    pids = [int(pid) for pid in re.findall(r"pid (\d+)", message)]
    assert len(set(pids)) == 3 and not any(is_alive(pid) for pid in pids)


def test_a_kv_cache_budget_below_one_block_on_every_rank_is_a_configuration_error(
        tiny_model):
    with pytest.raises(ConfigurationError) as refused:
        MultiprocExecutor(_config(tiny_model, ranks=2, kv_budget_gib=100 / _GIB))
    assert str(refused.value).endswith(
        "failed to start: ConfigurationError: The KV cache budget of 100 bytes is below one "
        "block of 16 tokens (4096 bytes); raise --kv-cache-memory-bytes")  # 1 KV head a rank


@pytest.mark.e2e
def test_the_default_model_on_two_ranks_generates_what_it_does_on_one():
    # SmolLM2-135M: 9 query heads on 3 KV heads, split 6+2 / 3+1; vocabulary 49152.
    tokenizer = load_tokenizer(None)
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Write a haiku about the sea."}]]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(chat)) for chat in chats]

    def generate(executor, num_blocks: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
        driver = StepDriver(executor, num_blocks)
        requests = [driver.add(f"chat{i}", p, GREEDY) for i, p in enumerate(prompts)]
        for _ in range(12):  # the prefill and 11 tokens: enough to show a diverging rank
            driver.step()
        return [r.output for r in requests]

    # Dequantized: kept quantized, the ranks' bfloat16 partial sums round differently from
    # one rank's whole sums, and a near tie can then flip a token.
    executor = MultiprocExecutor(_config(None, ranks=2, max_model_len=256, kv_budget_gib=0.05,
                                         quantization="none"))
    try:
        rank0, rank1 = executor.ready.statuses
        assert rank0.num_kv_blocks < rank1.num_kv_blocks  # rank 0 holds 2 KV heads, rank 1 one
        two_ranks = generate(executor, executor.num_kv_blocks)
    finally:
        executor.shutdown()
    assert two_ranks == generate(*_one_rank(_config(None, ranks=1, max_model_len=256,
                                                     kv_budget_gib=0.05, quantization="none")))
    assert "Paris" in tokenizer.decode(two_ranks[0])


def _decode_steps(req_id: str, prompt: list[int], num_decodes: int,
                  finished: list[str]) -> Iterator[SchedulerOutput]:
    """A prompt, then `num_decodes` one-token steps, as --async-scheduling sends them: each
    scheduled before the worker has sampled the token it computes."""
    yield SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(req_id=req_id, prompt_token_ids=prompt,
                                           sampling_params=GREEDY, block_ids=[0, 1])],
        scheduled_cached_reqs=[], num_scheduled_tokens={req_id: len(prompt)},
        finished_req_ids=finished)
    for i in range(num_decodes):
        yield SchedulerOutput(
            scheduled_new_reqs=[], scheduled_cached_reqs=[CachedRequestData(
                req_id=req_id, new_block_ids=[], num_computed_tokens=len(prompt) + i)],
            num_scheduled_tokens={req_id: 1}, finished_req_ids=[])


def test_steps_submitted_ahead_run_in_order_and_feed_their_own_tokens(tiny_model, executors):
    executor = executors(tiny_model)
    prompt = list(range(3, 20))
    expected = [executor.execute_model(step).sampled_token_ids
                for step in _decode_steps("sync", prompt, 6, [])]
    steps = _decode_steps("ahead", prompt, 6, ["sync"])
    executor.submit_step(next(steps))
    taken = []
    for step in steps:
        executor.submit_step(step)  # sent while the step before it runs
        taken.append(executor.take_step().sampled_token_ids)
    taken.append(executor.take_step().sampled_token_ids)
    assert taken == expected and len(expected) == 7
