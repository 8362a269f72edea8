"""The Worker: start-up order (general plugins first), the KV cache allocated once from the
budget, steps in and outputs out, and an out-of-tree model served through a plugin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gateway.config import CacheConfig, EngineConfig, ModelConfig
from gateway.messages import SchedulerOutput
from gateway.plugins import GENERAL_PLUGINS_GROUP
from gateway.sampling_params import SamplingParams
from gateway.worker.worker import Worker
from tests.plugin_dists import activate, forget_modules, subprocess_env, write_dist
from tests.step_driver import StepDriver
from tests.tiny_model import build_tiny_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
_GIB = 1024**3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny")


def _worker(model: Path, gib: float = 0.01, max_model_len: int | None = None) -> Worker:
    worker = Worker(EngineConfig(
        model=ModelConfig(model=str(model), dtype="float32", max_model_len=max_model_len),
        cache=CacheConfig(kv_cache_memory_gib=gib)))
    worker.init_device()
    worker.load_model()
    return worker


def test_kv_cache_blocks_come_from_the_budget(tiny: Path) -> None:
    worker = _worker(tiny, gib=0.002, max_model_len=512)
    num_blocks = worker.initialize_kv_cache()
    # 2 (K, V) x 2 layers x 2 kv heads x head dim 16 x 16 tokens x 4 bytes per block
    assert num_blocks == int(0.002 * _GIB) // (2 * 2 * 2 * 16 * 16 * 4)
    runner = worker.model_runner
    assert runner is not None
    assert runner.kv_caches[0].shape == (2, 2, num_blocks * 16, 16)


def test_the_kv_cache_is_never_reallocated(tiny: Path) -> None:
    worker = _worker(tiny)
    driver = StepDriver(worker, worker.initialize_kv_cache())
    runner = worker.model_runner
    assert runner is not None
    pointers = [cache.data_ptr() for cache in runner.kv_caches]
    driver.add("a", list(range(3, 40)), GREEDY)
    for _ in range(5):
        driver.step()
    assert [cache.data_ptr() for cache in runner.kv_caches] == pointers
    assert any(cache.abs().sum() > 0 for cache in runner.kv_caches)


def test_a_budget_below_one_full_sequence_gives_fewer_blocks(tiny: Path) -> None:
    worker = _worker(tiny, gib=0.0001)  # the engine core caps request lengths to fit
    assert worker.initialize_kv_cache() * 16 < worker.max_model_len


def test_a_budget_below_one_block_is_an_error(tiny: Path) -> None:
    worker = _worker(tiny, gib=1e-7)
    with pytest.raises(ValueError, match="below one block of 16 tokens"):
        worker.initialize_kv_cache()


def test_max_model_len_beyond_the_model_is_an_error(tiny: Path) -> None:
    with pytest.raises(ValueError, match="max_model_len 9000 .* context length 4096"):
        _worker(tiny, max_model_len=9000)


def test_what_the_worker_serves(tiny: Path) -> None:
    worker = _worker(tiny, max_model_len=256)
    assert worker.supported_tasks == ("generate",)
    assert worker.max_model_len == 256
    assert worker.vocab_size == json.loads((tiny / "config.json").read_text())["vocab_size"]


def test_chunked_prefill_samples_only_at_the_end_of_the_prompt(tiny: Path) -> None:
    worker = _worker(tiny)
    driver = StepDriver(worker, worker.initialize_kv_cache())
    driver.add("long", list(range(3, 53)), GREEDY)
    driver.add("short", [7, 8], GREEDY)
    first = driver.step(budget=20)  # long: 20 of 50 tokens, short waits
    assert first.req_ids == [] and first.sampled_token_ids == []
    second = driver.step(budget=30, only=["long"])  # alone, a chunk reading cached context
    assert second.req_ids == ["long"]
    third = driver.step()  # long decodes beside short's prompt
    assert sorted(third.req_ids) == ["long", "short"]


def test_greedy_generation_equals_transformers(tiny: Path) -> None:
    from transformers import LlamaForCausalLM

    worker = _worker(tiny)
    driver = StepDriver(worker, worker.initialize_kv_cache())
    prompts = {"a": [5, 9, 33, 7], "b": list(range(40, 71)), "c": [100]}
    for req_id, prompt in prompts.items():
        driver.add(req_id, prompt, GREEDY)
    for _ in range(12):
        driver.step()
    reference = LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    for request in driver.running:
        expected = reference.generate(torch.tensor([request.prompt]), max_new_tokens=12,
                                      min_new_tokens=12, do_sample=False)
        assert request.output == expected[0, len(request.prompt):].tolist()


def test_steps_before_loading_are_an_error(tiny: Path) -> None:
    worker = Worker(EngineConfig(model=ModelConfig(model=str(tiny))))
    with pytest.raises(RuntimeError, match="init_device"):
        _ = worker.max_model_len
    with pytest.raises(RuntimeError, match="load_model"):
        worker.execute_model(SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=[],
                                             num_scheduled_tokens={}, finished_req_ids=[]))


def test_init_device_loads_general_plugins_and_reports_them(
        tiny: Path, site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_dist(site, "worker-probe", {GENERAL_PLUGINS_GROUP: {"probe": "worker_probe:register"}},
               {"worker_probe": "CALLS = []\ndef register():\n    CALLS.append(1)\n"})
    activate(site, monkeypatch)
    try:
        worker = Worker(EngineConfig(model=ModelConfig(model=str(tiny))))
        worker.init_device()
        import worker_probe  # type: ignore[import-not-found]

        assert worker_probe.CALLS == [1]
        record = next(r for r in worker.plugin_report() if r["name"] == "probe")
        assert record["outcome"] == "called" and record["process_role"] == "worker-0"
    finally:
        forget_modules("worker_probe")


OUT_OF_TREE = """
import json, sys
from gateway.config import CacheConfig, EngineConfig, ModelConfig
from gateway.messages import NewRequestData, SchedulerOutput
from gateway.sampling_params import SamplingParams
from gateway.worker.worker import Worker

worker = Worker(EngineConfig(model=ModelConfig(model=sys.argv[1], dtype="float32"),
                             cache=CacheConfig(kv_cache_memory_gib=0.01)))
worker.init_device()
worker.load_model()
worker.initialize_kv_cache()
params = SamplingParams(temperature=0.0, max_tokens=4)
out = worker.execute_model(SchedulerOutput(
    scheduled_new_reqs=[NewRequestData(req_id="x", prompt_token_ids=[5, 6, 7],
                                       sampling_params=params, block_ids=[0])],
    scheduled_cached_reqs=[], num_scheduled_tokens={"x": 3}, finished_req_ids=[]))
model = worker.model_runner.model
print(json.dumps({"cls": type(model).__module__ + ":" + type(model).__name__,
                  "tokens": out.sampled_token_ids, "tasks": list(worker.supported_tasks),
                  "records": [[r["name"], r["outcome"], r["process_role"]]
                              for r in worker.plugin_report()]}))
"""


def test_an_out_of_tree_model_registered_by_a_general_plugin_is_served(
        tiny: Path, site: Path, tmp_path: Path) -> None:
    """Item 6: a plugin distribution registers "MyArch"; the worker, loading the general
    plugins itself in a fresh process, builds and runs it."""
    write_dist(site, "my-model-plugin",
               {GENERAL_PLUGINS_GROUP: {"my_model": "my_model_plugin:register"}},
               {"my_model_plugin": """
                    from gateway.models import ModelRegistry
                    def register():
                        if not ModelRegistry.is_registered("MyArch"):
                            ModelRegistry.register_model("MyArch", "my_model:MyModel")
                """,
                "my_model": """
                    from gateway.models.archs.decoder import LlamaForCausalLM
                    class MyModel(LlamaForCausalLM):
                        supported_tasks = ("generate",)
                """})
    folder = tmp_path / "my-model"
    folder.mkdir()
    for item in tiny.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["MyArch"]
    (folder / "config.json").write_text(json.dumps(config))

    result = subprocess.run([sys.executable, "-c", OUT_OF_TREE, str(folder)],
                            check=False, capture_output=True, text=True, timeout=180,
                            env=subprocess_env(site))
    assert result.returncode == 0, result.stderr
    served = json.loads(result.stdout.strip().splitlines()[-1])
    assert served["cls"] == "my_model:MyModel"
    assert len(served["tokens"]) == 1 and served["tasks"] == ["generate"]
    assert ["my_model", "called", "worker-0"] in served["records"]

    without = subprocess.run([sys.executable, "-c", OUT_OF_TREE, str(folder)],
                             check=False, capture_output=True, text=True, timeout=180,
                             env=subprocess_env())
    assert without.returncode != 0
    assert "MyArch" in without.stderr and "Registered architectures" in without.stderr
