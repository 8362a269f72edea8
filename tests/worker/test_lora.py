"""LoRA in the worker: a step mixing base-model rows and two adapters equals, row by row,
transformers with PEFT's merged model (float32, within 1e-4), through prefill, decode
and adapters moving in and out of the slots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gateway.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
from gateway.lora_request import LoRARequest
from gateway.sampling_params import SamplingParams
from gateway.worker.worker import Worker
from tests.step_driver import StepDriver
from tests.tiny_lora import build_tiny_lora, merged_reference
from tests.tiny_model import build_tiny_llama

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    model = build_tiny_llama(root / "model")
    return {"model": model,
            "a": build_tiny_lora(model, root / "a", rank=4, seed=1),
            "b": build_tiny_lora(model, root / "b", rank=8, seed=2, use_rslora=True,
                                 targets=("q_proj", "v_proj", "down_proj")),
            "c": build_tiny_lora(model, root / "c", rank=2, seed=3)}


def _worker(model: Path, max_loras: int) -> tuple[Worker, StepDriver, list[torch.Tensor]]:
    worker = Worker(EngineConfig(model=ModelConfig(model=str(model), dtype="float32"),
                                 cache=CacheConfig(kv_cache_memory_gib=0.01),
                                 lora=LoRAConfig(max_loras=max_loras, max_lora_rank=8,
                                                 max_cpu_loras=max_loras)))
    worker.init_device()
    worker.load_model()
    driver = StepDriver(worker, worker.initialize_kv_cache())
    runner = worker.model_runner
    captured: list[torch.Tensor] = []
    sample = runner.sampler.sample_on_device  # type: ignore[union-attr]

    def capture(logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        captured.append(logits.float().clone())
        return sample(logits, *args, **kwargs)

    runner.sampler.sample_on_device = capture  # type: ignore[union-attr, method-assign]
    return worker, driver, captured


def _params(lora: LoRARequest | None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, lora_request=lora)


def test_a_step_mixing_adapters_equals_each_merged_model(tiny: dict[str, Path]) -> None:
    names = ("a", "b", "c")
    loras = {name: LoRARequest(lora_name=name, lora_int_id=i + 1, lora_path=str(tiny[name]))
             for i, name in enumerate(names)}
    references = {None: merged_reference(tiny["model"], None),
                  **{name: merged_reference(tiny["model"], tiny[name]) for name in names}}
    worker, driver, captured = _worker(tiny["model"], max_loras=2)
    generator = torch.Generator().manual_seed(0)
    adapter_of = {}

    def add(req_id: str, adapter: str | None, length: int) -> None:
        prompt = torch.randint(3, worker.vocab_size, (length,), generator=generator).tolist()
        driver.add(req_id, prompt, _params(None if adapter is None else loras[adapter]))
        adapter_of[req_id] = adapter

    def step(budget: int = 64) -> int:
        output = driver.step(budget)
        by_id = {r.req_id: r for r in driver.running}
        for row, req_id in enumerate(output.req_ids):
            tokens = by_id[req_id].all_tokens[:-1]
            with torch.no_grad():
                expected = references[adapter_of[req_id]](torch.tensor([tokens])).logits[0, -1]
            difference = (captured[-1][row] - expected).abs().max().item()
            assert difference < TOLERANCE, (req_id, adapter_of[req_id], difference)
        return len(output.req_ids)

    for req_id, adapter, length in (("base", None, 7), ("a1", "a", 5), ("b1", "b", 11),
                                    ("a2", "a", 3)):
        add(req_id, adapter, length)
    checked = sum(step() for _ in range(3))  # one prefill step, then decodes, all mixed
    for req_id in ("b1", "a1", "a2"):
        driver.finish(req_id)
    add("c1", "c", 6)  # a third adapter takes the slot of the least recently used one
    add("b2", "b", 4)  # and b comes back from the host cache into the other
    checked += sum(step() for _ in range(3))
    driver.finish("b2")
    driver.finish("c1")
    checked += step()  # the base row alone: no adapter in the step
    assert checked == 4 * 3 + 3 * 3 + 1


def test_the_lora_differs_from_the_base_model(tiny: dict[str, Path]) -> None:
    """(So that the equality above is no accident of a zero adapter.)"""
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        base = merged_reference(tiny["model"], None)(prompt).logits
        adapted = merged_reference(tiny["model"], tiny["a"])(prompt).logits
    assert (base - adapted).abs().max().item() > 0.01


def test_an_adapter_whose_folder_vanished_fails_its_request_alone(tiny: dict[str, Path],
                                                                  tmp_path: Path) -> None:
    import shutil

    folder = shutil.copytree(tiny["a"], tmp_path / "gone")
    lora = LoRARequest(lora_name="gone", lora_int_id=9, lora_path=str(folder))
    worker, driver, _ = _worker(tiny["model"], max_loras=1)
    shutil.rmtree(folder)  # after the API server's check, before the worker reads it
    driver.add("gone", [5, 6, 7], _params(lora))
    driver.add("base", [5, 6, 7], _params(None))
    output = driver.step()
    assert output.req_ids == ["base"]
    assert "LoRA adapter 'gone' could not be read" in output.errors["gone"]
