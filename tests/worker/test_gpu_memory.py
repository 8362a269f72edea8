"""KV-cache sizing from --gpu-memory-utilization: the arithmetic against stated device
sizes, the dummy steps it profiles (run through a real worker on the CPU), and the CPU's
budget, which does not change."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gateway.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from gateway.sampling_params import SamplingParams
from gateway.worker.gpu_memory import (
    CudaMemoryProbe,
    DeviceMemory,
    KvCacheSizeError,
    kv_cache_budget_bytes,
    num_kv_blocks_for_utilization,
    num_profile_blocks,
    profile_prompt_lengths,
    profile_step,
    run_profile_steps,
)
from gateway.worker.model_runner import ModelRunner
from gateway.worker.worker import Worker
from tests.step_driver import StepDriver
from tests.tiny_model import build_tiny_llama

GIB = 1024**3
MIB = 1024**2
# One token of Llama-3.2-1B's shape in bf16: 2 (K, V) x 16 layers x 8 KV heads x 64 x 2 B.
LLAMA_1B_TOKEN = 2 * 16 * 8 * 64 * 2


def memory(total_gib: float, weights_gib: float, peak_gib: float, free_gib: float | None = None,
           **extra: int) -> DeviceMemory:
    free = total_gib - 0.5 if free_gib is None else free_gib  # the CUDA context's share
    return DeviceMemory(total_bytes=int(total_gib * GIB), free_bytes=int(free * GIB),
                        weight_bytes=int(weights_gib * GIB),
                        activation_peak_bytes=int(peak_gib * GIB), **extra)


@pytest.mark.parametrize(("total_gib", "utilization", "weights_gib", "peak_gib"), [
    (80, 0.9, 2.35, 0.75),    # a 1B model on an 80 GiB card
    (139.8, 0.9, 2.35, 0.75),  # the same on a 141 GB card
    (24, 0.9, 15.0, 1.5),     # an 8B model in bf16 on a 24 GiB card
    (40, 0.5, 2.35, 0.75),    # half a card
    (16, 1.0, 2.0, 0.5, ),    # the whole card (the context's share was not free: see below)
])
def test_the_kv_cache_gets_what_the_utilization_leaves(total_gib, utilization, weights_gib,
                                                        peak_gib):
    free_gib = total_gib if utilization == 1.0 else None
    device = memory(total_gib, weights_gib, peak_gib, free_gib)
    blocks = num_kv_blocks_for_utilization(device, utilization, LLAMA_1B_TOKEN, 16)
    left = (math.ceil(int(total_gib * GIB) * utilization) - int(weights_gib * GIB)
            - int(peak_gib * GIB))
    assert blocks == left // (LLAMA_1B_TOKEN * 16)
    assert blocks * LLAMA_1B_TOKEN * 16 <= left < (blocks + 1) * LLAMA_1B_TOKEN * 16


def test_an_80_gib_card_holds_about_two_million_tokens_of_a_1b_model():
    blocks = num_kv_blocks_for_utilization(memory(80, 2.35, 0.75), 0.9, LLAMA_1B_TOKEN, 16)
    assert 2_250_000 < blocks * 16 < 2_260_000  # (72 - 3.1) GiB / 32 KiB a token


def test_memory_outside_torch_and_graphs_come_off_the_kv_cache():
    plain = memory(80, 2.35, 0.75)
    other = memory(80, 2.35, 0.75, non_torch_bytes=512 * MIB, graph_bytes=256 * MIB)
    assert kv_cache_budget_bytes(plain, 0.9) - kv_cache_budget_bytes(other, 0.9) == 768 * MIB


def test_a_larger_block_holds_the_same_bytes_in_fewer_blocks():
    device = memory(24, 15.0, 1.5)
    small = num_kv_blocks_for_utilization(device, 0.9, LLAMA_1B_TOKEN, 16)
    large = num_kv_blocks_for_utilization(device, 0.9, LLAMA_1B_TOKEN, 32)
    assert large == small // 2


def test_a_model_that_does_not_fit_stops_with_one_line_naming_the_sizes_and_the_flag():
    with pytest.raises(KvCacheSizeError) as caught:
        num_kv_blocks_for_utilization(memory(24, 21.0, 1.5), 0.9, LLAMA_1B_TOKEN, 16)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("The model does not fit the GPU at --gpu-memory-utilization 0.9")
    assert "0.9 of 24.00 GiB leaves -0.90 GiB for the KV cache" in message
    assert "weights 21.00 GiB, activation peak 1.50 GiB" in message
    assert "raise --gpu-memory-utilization" in message


def test_less_than_one_block_left_is_not_enough():
    device = memory(1, 0.0, 0.0)
    budget = kv_cache_budget_bytes(device, 0.5)
    one_block = budget + 1  # bytes a block of 1 token needs: just over what is left
    with pytest.raises(KvCacheSizeError, match="less than one block of 1 tokens"):
        num_kv_blocks_for_utilization(device, 0.5, one_block, 1)
    assert num_kv_blocks_for_utilization(device, 0.5, budget, 1) == 1


def test_a_device_that_others_hold_stops_start_up_naming_the_free_memory():
    busy = memory(80, 2.35, 0.75, free_gib=40)
    with pytest.raises(KvCacheSizeError) as caught:
        num_kv_blocks_for_utilization(busy, 0.9, LLAMA_1B_TOKEN, 16)
    assert str(caught.value).startswith(
        "Only 40.00 GiB of the GPU's 80.00 GiB were free at start-up, less than the 72.00 "
        "GiB that --gpu-memory-utilization 0.9 asks for")
    assert num_kv_blocks_for_utilization(busy, 0.45, LLAMA_1B_TOKEN, 16) > 0


@pytest.mark.parametrize("utilization", [0, -0.1, 1.01, float("nan")])
def test_a_utilization_outside_zero_to_one_is_refused(utilization):
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization must be in \(0, 1\]"):
        num_kv_blocks_for_utilization(memory(80, 1, 1), utilization, LLAMA_1B_TOKEN, 16)


# ---------------------------------------------------------------------- profiled steps
@pytest.mark.parametrize(("tokens", "seqs", "model_len", "expected"), [
    (2048, 256, 4096, [[2048], [8] * 256]),
    (2048, 64, 512, [[512] * 4, [32] * 64]),
    (100, 256, 4096, [[100], [1] * 100]),
    (2048, 2, 512, [[512, 512]]),  # two sequences of the longest length: one step
    (10, 3, 4096, [[10], [4, 3, 3]]),
])
def test_the_profiled_steps_are_the_longest_and_the_widest_the_scheduler_may_run(
        tokens, seqs, model_len, expected):
    steps = profile_prompt_lengths(tokens, seqs, model_len)
    assert steps == expected
    assert all(len(step) <= seqs and max(step) <= model_len for step in steps)


def test_a_profiled_step_gives_each_prompt_its_own_blocks():
    step = profile_step([20, 16, 1], block_size=16)
    assert [r.block_ids for r in step.scheduled_new_reqs] == [[0, 1], [2], [3]]
    assert list(step.num_scheduled_tokens.values()) == [20, 16, 1]
    assert num_profile_blocks([[20, 16, 1], [16] * 3], 16) == 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny")


def _worker(model: Path, gib: float | None = 0.01) -> Worker:
    worker = Worker(EngineConfig(
        model=ModelConfig(model=str(model), dtype="float32", max_model_len=256),
        cache=CacheConfig(kv_cache_memory_gib=gib),
        scheduler=SchedulerConfig(max_num_batched_tokens=300, max_num_seqs=4)))
    worker.init_device()
    worker.load_model()
    return worker


def _greedy_tokens(worker: Worker) -> list[int]:
    driver = StepDriver(worker, worker.initialize_kv_cache())
    request = driver.add("a", list(range(3, 40)),
                         SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for _ in range(8):
        driver.step()
    return request.output


def test_the_profiled_steps_run_through_a_real_runner_and_leave_it_as_built(tiny: Path):
    worker = _worker(tiny)
    runner = worker.model_runner
    assert isinstance(runner, ModelRunner)
    steps = profile_prompt_lengths(300, 4, worker.max_model_len)
    assert steps == [[256, 44], [75] * 4]
    runner.initialize_kv_cache(num_profile_blocks(steps, runner.block_size))
    run_profile_steps(runner, steps)
    assert runner.batch.requests == {} and runner.batch.num_rows == 0
    runner.release_kv_cache()
    assert runner.kv_caches == [] and runner.num_blocks == 0
    assert _greedy_tokens(worker) == _greedy_tokens(_worker(tiny))


def test_the_cpu_budget_is_one_gib_unless_given_and_the_utilization_does_not_apply(
        tiny: Path, caplog: pytest.LogCaptureFixture):
    default = _worker(tiny, gib=None)
    assert default.memory_probe is None
    runner = default.model_runner
    assert isinstance(runner, ModelRunner)
    assert default.num_kv_blocks_in_budget() == GIB // runner.kv_cache_bytes_per_block()
    assert "does not apply" not in caplog.text
    default.config.cache.gpu_memory_utilization = 0.5
    with caplog.at_level("INFO", logger="gateway.worker.worker"):
        default.num_kv_blocks_in_budget()
    assert "--gpu-memory-utilization does not apply: the KV cache budget is 1.0 GiB on cpu" \
        in caplog.text


class StatedDevice(CudaMemoryProbe):
    """A device of stated sizes: the worker's profiled steps run for real (on the CPU),
    and the memory they report is what the test states."""

    def __init__(self, memory: DeviceMemory) -> None:
        super().__init__(torch.device("cpu"))
        self.memory, self.steps = memory, []  # type: list[list[int]]

    def profile(self, runner: ModelRunner, steps: list[list[int]],
                graph_bytes: Callable[[], int] | None = None) -> DeviceMemory:
        assert graph_bytes is None  # no CUDA graphs on the CPU
        self.steps = steps
        runner.initialize_kv_cache(num_profile_blocks(steps, runner.block_size))
        run_profile_steps(runner, steps)
        runner.release_kv_cache()
        return self.memory


def test_a_worker_on_a_stated_device_sizes_its_kv_cache_by_utilization_and_serves(
        tiny: Path, caplog: pytest.LogCaptureFixture):
    worker = _worker(tiny, gib=None)
    device = StatedDevice(memory(1, 0.25, 0.125))
    worker.memory_probe = device
    worker.config.cache.gpu_memory_utilization = 0.5
    runner = worker.model_runner
    assert isinstance(runner, ModelRunner)
    with caplog.at_level("INFO", logger="gateway.worker.worker"):
        num_blocks = worker.initialize_kv_cache()
    assert device.steps == [[256, 44], [75] * 4]  # --max-num-batched-tokens 300, 4 seqs
    assert num_blocks == (GIB // 2 - GIB // 4 - GIB // 8) // runner.kv_cache_bytes_per_block()
    assert "GPU memory at --gpu-memory-utilization 0.5 of 1.00 GiB: weights 0.25 GiB, " \
        "activation peak 0.12 GiB" in caplog.text
    driver = StepDriver(worker, num_blocks)
    request = driver.add("a", list(range(3, 40)),
                         SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for _ in range(8):
        driver.step()
    assert request.output == _greedy_tokens(_worker(tiny))


def test_a_worker_whose_model_does_not_fit_its_stated_device_stops(tiny: Path):
    worker = _worker(tiny, gib=None)
    worker.memory_probe = StatedDevice(memory(1, 0.75, 0.25, free_gib=1))
    with pytest.raises(KvCacheSizeError, match=r"^The model does not fit the GPU at "
                       r"--gpu-memory-utilization 0.9: 0.9 of 1.00 GiB leaves -0.10 GiB"):
        worker.initialize_kv_cache()


def test_a_kv_cache_budget_given_in_bytes_wins_over_the_utilization(tiny: Path):
    worker = _worker(tiny, gib=64 * MIB / GIB)
    device = StatedDevice(memory(1, 0.75, 0.25, free_gib=1))  # would not fit by utilization
    worker.memory_probe = device
    runner = worker.model_runner
    assert isinstance(runner, ModelRunner)
    assert worker.initialize_kv_cache() == 64 * MIB // runner.kv_cache_bytes_per_block()
    assert device.steps == []  # nothing profiled


def test_a_budget_below_one_block_stops_gateway_serve_with_one_line(tiny: Path):
    result = subprocess.run([sys.executable, "-m", "gateway.frontend.cli.main", "serve",
                             str(tiny), "--port", "0", "--kv-cache-memory-bytes", "100"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "failed to start" in line]
    assert line.endswith("Engine core failed to start: The KV cache budget of 100 bytes is "
                         "below one block of 16 tokens (4096 bytes); raise "
                         "--kv-cache-memory-bytes")


def test_only_a_cuda_worker_without_a_fixed_budget_profiles(tiny: Path):
    cpu = _worker(tiny, gib=None)
    assert not cpu.sizes_kv_cache_by_profiling  # no CUDA memory to read
    cpu.memory_probe = StatedDevice(memory(1, 0.25, 0.125))
    assert cpu.sizes_kv_cache_by_profiling
    cpu.config.cache.kv_cache_memory_gib = 0.01
    assert not cpu.sizes_kv_cache_by_profiling
