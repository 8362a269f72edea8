"""The scheduler and LoRA adapters: no step holds more distinct adapters than
--max-loras (a request of another adapter waits, and the requests behind it may start);
the prefix cache never shares blocks between adapters, or between an adapter and the base."""

from __future__ import annotations

from gateway.config import SchedulerConfig
from gateway.engine.kv_cache_manager import KVCacheManager
from gateway.engine.request import Request
from gateway.engine.scheduler import Scheduler
from gateway.lora_request import LoRARequest
from gateway.messages import EngineCoreRequest
from gateway.sampling_params import SamplingParams
from tests.engine.test_scheduler import run_step


def _scheduler(max_loras: int) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                     KVCacheManager(64, 4, True), 256, [2], max_loras=max_loras)


def _add(scheduler: Scheduler, rid: str, adapter: int | None, prompt_len: int = 5,
         max_tokens: int = 3) -> None:
    lora = None if adapter is None else LoRARequest(
        lora_name=f"lora{adapter}", lora_int_id=adapter, lora_path=f"/adapters/{adapter}")
    params = SamplingParams(max_tokens=max_tokens, lora_request=lora)
    scheduler.add_request(Request(EngineCoreRequest(
        rid, list(range(10, 10 + prompt_len)), params, 0.0), scheduler.max_model_len))


def test_a_step_holds_at_most_max_loras_adapters_and_the_others_wait() -> None:
    scheduler = _scheduler(max_loras=2)
    for rid, adapter in (("a1", 1), ("b1", 2), ("c1", 3), ("base", None), ("a2", 1)):
        _add(scheduler, rid, adapter)
    out, _ = run_step(scheduler)
    assert set(out.num_scheduled_tokens) == {"a1", "b1", "base", "a2"}  # c1 waits
    assert [r.request_id for r in scheduler.waiting] == ["c1"]
    for _ in range(3):  # a and b finish (3 tokens each); then c starts
        out, _ = run_step(scheduler)
    assert "c1" in out.num_scheduled_tokens


def test_the_prefix_cache_keeps_adapters_apart() -> None:
    scheduler = _scheduler(max_loras=4)
    for rid, adapter in (("first", 1), ("same", 1), ("other", 2), ("base", None)):
        _add(scheduler, rid, adapter, prompt_len=12, max_tokens=1)
        run_step(scheduler)
        run_step(scheduler)
    stats = scheduler.kv_cache.take_stats()
    assert stats is not None
    assert stats.hits == 8  # "same" found first's two full blocks; "other" and "base" none
