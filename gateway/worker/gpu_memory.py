"""The KV cache of a CUDA worker sized from `--gpu-memory-utilization`, as vLLM sizes it
(worker process): the arithmetic as a plain function, the dummy steps the worker profiles
before it, and the measurement around them.

The budget is `utilization` x the device's total memory. It holds the weights, the
activation peak of the largest step the scheduler may run (`--max-num-batched-tokens`
prompt tokens), the memory grown outside torch's allocator meanwhile and, in what is
left, the KV cache. The decode steps' CUDA graphs (cuda_graphs.py) are captured after
the KV cache is allocated; the memory they will take is measured before, by one capture
of the largest on the profiling cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.config import ConfigurationError
from gateway.messages import NewRequestData, SchedulerOutput
from gateway.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from gateway.worker.model_runner import ModelRunner

_GIB = 1024**3
_PROFILE_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


class KvCacheSizeError(ConfigurationError):
    """The model does not fit the device at the configured utilization."""


@dataclass(frozen=True)
class DeviceMemory:
    """What a worker measured on its device, in bytes."""

    total_bytes: int
    free_bytes: int  # free when the worker started, before its weights loaded
    weight_bytes: int
    activation_peak_bytes: int  # above the weights, during the profiled steps
    non_torch_bytes: int = 0  # grown outside torch's allocator (cuBLAS workspaces, NCCL)
    graph_bytes: int = 0  # CUDA graphs

    def describe(self) -> str:
        return (f"weights {_gib(self.weight_bytes)}, activation peak "
                f"{_gib(self.activation_peak_bytes)}, outside torch "
                f"{_gib(self.non_torch_bytes)}, CUDA graphs {_gib(self.graph_bytes)}")


def check_utilization(utilization: float) -> None:
    """Raise ValueError unless 0 < utilization <= 1."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")


def kv_cache_budget_bytes(memory: DeviceMemory, utilization: float) -> int:
    """The bytes left for the KV cache (may be negative); KvCacheSizeError when the device
    had less free memory at start-up than the utilization asks for."""
    check_utilization(utilization)
    requested = min(math.ceil(memory.total_bytes * utilization), memory.total_bytes)
    if memory.free_bytes < requested:
        raise KvCacheSizeError(
            f"Only {_gib(memory.free_bytes)} of the GPU's {_gib(memory.total_bytes)} were "
            f"free at start-up, less than the {_gib(requested)} that "
            f"--gpu-memory-utilization {utilization} asks for (other processes hold the "
            "rest): lower --gpu-memory-utilization or free the GPU")
    return (requested - memory.weight_bytes - memory.activation_peak_bytes
            - memory.non_torch_bytes - memory.graph_bytes)


def num_kv_blocks_for_utilization(memory: DeviceMemory, utilization: float,
                                  bytes_per_token: int, block_size: int) -> int:
    """The KV-cache blocks of `block_size` tokens (`bytes_per_token` each) that fit in
    `utilization` of the device beside the weights, the activation peak, the memory outside
    torch and the graphs; KvCacheSizeError, one line naming the sizes and the flag to
    change, when not even one block fits."""
    budget = kv_cache_budget_bytes(memory, utilization)
    bytes_per_block = bytes_per_token * block_size
    if budget < bytes_per_block:
        raise KvCacheSizeError(
            f"The model does not fit the GPU at --gpu-memory-utilization {utilization}: "
            f"{utilization} of {_gib(memory.total_bytes)} leaves {_gib(budget)} for the KV "
            f"cache after {memory.describe()}, less than one block of {block_size} tokens "
            f"({bytes_per_block} bytes): raise --gpu-memory-utilization, or lower "
            "--max-num-batched-tokens")
    return budget // bytes_per_block


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / _GIB:.2f} GiB"


# ---------------------------------------------------------------------- profiled steps
def profile_prompt_lengths(num_tokens: int, max_num_seqs: int,
                           max_model_len: int) -> list[list[int]]:
    """The prompts of the dummy steps, each as large as one step may be: the fewest,
    longest prompts (attention's largest products), then the most, shortest ones (a row of
    logits and sampling for each of `max_num_seqs` sequences)."""
    whole, rest = divmod(num_tokens, max_model_len)
    longest = ([max_model_len] * whole + ([rest] if rest else []))[:max_num_seqs]
    widest = _split(num_tokens, min(max_num_seqs, num_tokens), max_model_len)
    return [longest] + ([widest] if widest != longest else [])


def _split(total: int, parts: int, cap: int) -> list[int]:
    """`parts` lengths, as even as they can be, summing to `total` (each at most `cap`)."""
    base, extra = divmod(total, parts)
    return [min(base + (index < extra), cap) for index in range(parts)]


def num_profile_blocks(steps: list[list[int]], block_size: int) -> int:
    """The KV-cache blocks the largest dummy step holds."""
    return max(sum(-(-length // block_size) for length in step) for step in steps)


def profile_step(lengths: list[int], block_size: int, token_id: int = 0) -> SchedulerOutput:
    """One step of fresh prompts of these lengths (greedy, one token each), in blocks
    numbered from 0."""
    new, first_block = [], 0
    for index, length in enumerate(lengths):
        num_blocks = -(-length // block_size)
        new.append(NewRequestData(
            req_id=f"profile-{index}", prompt_token_ids=[token_id] * length,
            sampling_params=_PROFILE_PARAMS,
            block_ids=list(range(first_block, first_block + num_blocks))))
        first_block += num_blocks
    return SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=[],
                           num_scheduled_tokens={r.req_id: len(r.prompt_token_ids)
                                                 for r in new},
                           finished_req_ids=[])


def run_profile_steps(runner: ModelRunner, steps: list[list[int]]) -> None:
    """Run each dummy step through `runner` (its KV cache holds num_profile_blocks), then
    finish its requests: the runner holds no request afterwards."""
    for lengths in steps:
        step = profile_step(lengths, runner.block_size)
        runner.execute_model(step)
        runner.execute_model(SchedulerOutput(
            scheduled_new_reqs=[], scheduled_cached_reqs=[], num_scheduled_tokens={},
            finished_req_ids=list(step.num_scheduled_tokens)))


@dataclass
class CudaMemoryProbe:
    """Reads a CUDA device's memory at the worker's start, after the weights load, and
    around the profiled steps."""

    device: torch.device
    total_bytes: int = 0
    free_bytes: int = 0  # at start
    reserved_at_start: int = 0
    allocated_before_load: int = 0
    weight_bytes: int = 0

    def at_start(self) -> None:
        import torch

        self.free_bytes, self.total_bytes = torch.cuda.mem_get_info(self.device)
        self.reserved_at_start = torch.cuda.memory_reserved(self.device)
        self.allocated_before_load = torch.cuda.memory_allocated(self.device)

    def after_load(self) -> None:
        import torch

        self.weight_bytes = torch.cuda.memory_allocated(self.device) - self.allocated_before_load

    def profile(self, runner: ModelRunner, steps: list[list[int]],
                graph_bytes: Callable[[], int] | None = None) -> DeviceMemory:
        """Run the dummy steps on a temporary KV cache and measure their peak above the
        weights and that cache, and the CUDA graphs' memory (`graph_bytes`, measured on
        the same cache, cuda_graphs.estimate_on_cuda); the cache is released afterwards."""
        import torch

        runner.initialize_kv_cache(num_profile_blocks(steps, runner.block_size))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        run_profile_steps(runner, steps)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        graphs = 0 if graph_bytes is None else graph_bytes()
        runner.release_kv_cache()
        torch.cuda.empty_cache()
        free_now, _ = torch.cuda.mem_get_info(self.device)
        grown = self.free_bytes - free_now  # used since the start, by torch or not
        torch_grown = torch.cuda.memory_reserved(self.device) - self.reserved_at_start
        return DeviceMemory(total_bytes=self.total_bytes, free_bytes=self.free_bytes,
                            weight_bytes=self.weight_bytes, activation_peak_bytes=peak,
                            non_torch_bytes=max(grown - torch_grown, 0), graph_bytes=graphs)
