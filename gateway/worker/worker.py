"""The worker (worker process, or in-process under the `uni` executor): a plain class the
engine core drives. `init_device()` -> `load_model()` -> `initialize_kv_cache()`, then
`execute_model()` once per step.

`init_device()` loads the general plugins first, so that an out-of-tree model a plugin
registers (ModelRegistry.register_model) is known before the model is built. On a CUDA
device `initialize_kv_cache()` then captures the decode steps' graphs (cuda_graphs.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gateway import envs
from gateway.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_KV_CACHE_MEMORY_GIB,
    ConfigurationError,
    EngineConfig,
    SpeculativeConfig,
)
from gateway.logger import init_logger
from gateway.messages import ModelRunnerOutput, SchedulerOutput
from gateway.models.info.paths import POOLING_TASKS, ModelInfo, read_model_info
from gateway.models.layers.parallel import TensorParallel
from gateway.models.loading.loader import explain_dtype, load_model, resolve_model_dtype
from gateway.plugins import load_report, start_process, this_process
from gateway.process_start import load_process_plugins
from gateway.tokenizer import load_tokenizer
from gateway.worker import cuda_graphs
from gateway.worker.cpu_threads import allowed_cores, apply_threads, plan_threads
from gateway.worker.draft_proposer import DraftProposer
from gateway.worker.gpu_memory import (
    CudaMemoryProbe,
    num_kv_blocks_for_utilization,
    profile_prompt_lengths,
)
from gateway.worker.lora_manager import LoRAManager
from gateway.worker.model_runner import ModelRunner
from gateway.worker.pooling_runner import PoolingModelRunner
from gateway.worker.sampler import Sampler

logger = init_logger(__name__)

_GIB = 1024**3


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0,
                 tp: TensorParallel | None = None) -> None:
        self.config = config
        self.rank = rank
        self.tp = tp  # the ranks this model is split over (None: not split)
        self.info: ModelInfo | None = None
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None
        self.model_runner: ModelRunner | PoolingModelRunner | None = None
        self.num_blocks = 0
        self.eos_token_ids: list[int] = []  # known after load_model
        # A CUDA device's memory, read from init_device on: the KV cache is sized from it.
        self.memory_probe: CudaMemoryProbe | None = None

    # ------------------------------------------------------------------ start-up
    def init_device(self) -> None:
        """Load the general plugins, pick the device, dtype and thread count, read the
        model's config. Raises ValueError for a dtype the device cannot run."""
        # A process the gateway started to serve (engine core, worker) has a role; a user's
        # or a test's own process (in-process worker) keeps every core and is not pinned.
        is_serving_process = this_process().role != "main"
        if not is_serving_process:  # not named by whoever started this process
            start_process(f"worker-{self.rank}")
        load_process_plugins()  # a worker process loaded them before joining its ranks
        from gateway.platforms import current_platform

        parallel = self.config.parallel
        # Every engine's ranks on this machine share its devices and cores (data parallel).
        local_index = parallel.local_worker_index(self.rank)
        self.device = current_platform.torch_device(local_index)
        if self.device.type == "cuda":
            self.memory_probe = CudaMemoryProbe(self.device)
            self.memory_probe.at_start()
        threads = "device threads"
        if current_platform.is_cpu():
            plan = plan_threads(allowed_cores(), parallel.num_local_workers, local_index,
                                placement=is_serving_process,
                                reserved=envs.cpu_reserved_cores(), bind=envs.cpu_threads_bind())
            apply_threads(plan)
            threads = plan.describe()
        torch.manual_seed(self.config.model.seed)
        self.info = read_model_info(self.config.model.model)
        model = self.config.model
        self.dtype = resolve_model_dtype(model.dtype, type(current_platform), self.info,
                                         model.quantization)
        self._check_max_model_len(self.info)
        logger.info("Worker %d: %s on %s (%s platform), %s (%s), %s", self.rank,
                    self.info.path, self.device, current_platform.device_name, self.dtype,
                    explain_dtype(model.dtype, type(current_platform), self.info,
                                  model.quantization),
                    threads)

    def load_model(self) -> None:
        info, device, dtype = self._require_device()
        model = load_model(info, device, dtype, self.tp, self.config.model.quantization)
        speculative = self.config.speculative
        draft = None if speculative is None or not speculative.uses_draft_model \
            else self._load_draft(speculative)
        if self.memory_probe is not None:  # the weights of both models
            self.memory_probe.after_load()
        tasks = getattr(model, "supported_tasks", None) or info.supported_tasks
        if any(task in POOLING_TASKS for task in tasks):  # an encoder: no sampler, no KV cache
            self.model_runner = PoolingModelRunner(model, info.pooling, device,
                                                   self.max_model_len, info.vocab_size,
                                                   info.hidden_size, tasks)
            return
        self.eos_token_ids = load_tokenizer(info.path).eos_token_ids
        sampler = Sampler(self.config.model, self.vocab_size, self.eos_token_ids, device)
        self.model_runner = ModelRunner(model, sampler, device, dtype,
                                        self.config.cache.block_size, self.max_model_len)
        if self.config.lora is not None:
            self.model_runner.lora = LoRAManager(model, self.config.lora, device, dtype)
        if draft is not None and speculative is not None:
            self.model_runner.drafter = DraftProposer(draft, self.model_runner,
                                                      speculative.num_speculative_tokens)

    def _load_draft(self, speculative: SpeculativeConfig) -> nn.Module:
        """The draft model, on the target's device and dtype; refused (one line naming
        the field) when its vocabulary or tokenizer is not the target's: its proposals
        are token ids the target must read as the same tokens."""
        info, device, dtype = self._require_device()
        draft = read_model_info(speculative.model)
        if draft.vocab_size != info.vocab_size:
            raise ConfigurationError(
                f"--speculative-config: field 'model': the draft model's vocabulary has "
                f"{draft.vocab_size} tokens, the target's {info.vocab_size}; a draft must "
                "share the target's vocabulary")
        if _vocab(draft.path) != _vocab(info.path):
            raise ConfigurationError(
                "--speculative-config: field 'model': the draft model's tokenizer differs "
                "from the target's; a draft must share the target's tokenizer")
        quantization = self.config.model.quantization if draft.format == "gguf" else None
        model = load_model(draft, device, dtype, None, quantization)
        logger.info("Draft model: %s, %d speculative tokens", draft.path,
                    speculative.num_speculative_tokens)
        return model

    def num_kv_blocks_in_budget(self) -> int:
        """The KV-cache blocks this worker's budget holds (0: no KV cache): the configured
        budget, or on a CUDA device without one what --gpu-memory-utilization leaves after
        a profiled step.

        A budget below max_model_len tokens is allowed (the engine core then caps request
        lengths); one below a single block is an error."""
        runner = self._require_runner()
        if isinstance(runner, PoolingModelRunner):
            return 0
        cache = self.config.cache
        if self.sizes_kv_cache_by_profiling and self.memory_probe is not None:
            return self._num_kv_blocks_by_utilization(runner, self.memory_probe)
        if cache.gpu_memory_utilization != DEFAULT_GPU_MEMORY_UTILIZATION:
            logger.info("--gpu-memory-utilization does not apply: the KV cache budget is %s",
                        "--kv-cache-memory-bytes" if cache.kv_cache_memory_gib is not None
                        else f"{DEFAULT_KV_CACHE_MEMORY_GIB} GiB on {self.device_type}")
        gib = DEFAULT_KV_CACHE_MEMORY_GIB if cache.kv_cache_memory_gib is None \
            else cache.kv_cache_memory_gib
        bytes_per_block = runner.kv_cache_bytes_per_block()
        budget = int(gib * _GIB)  # exact for a size given in bytes
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ConfigurationError(
                f"The KV cache budget of {budget} bytes is below one block of "
                f"{cache.block_size} tokens ({bytes_per_block} bytes); raise "
                "--kv-cache-memory-bytes")
        return num_blocks

    @property
    def sizes_kv_cache_by_profiling(self) -> bool:
        """Whether the KV cache is sized from --gpu-memory-utilization after profiled steps
        (a CUDA device, no --kv-cache-memory-bytes, a model with a KV cache)."""
        return (self.memory_probe is not None and self.config.cache.kv_cache_memory_gib is None
                and isinstance(self.model_runner, ModelRunner))

    def _num_kv_blocks_by_utilization(self, runner: ModelRunner,
                                      probe: CudaMemoryProbe) -> int:
        cache, scheduler = self.config.cache, self.config.scheduler
        steps = profile_prompt_lengths(scheduler.max_num_batched_tokens,
                                       scheduler.max_num_seqs, self.max_model_len)
        sizes, _ = self._graph_sizes(runner)
        started = time.perf_counter()
        memory = probe.profile(runner, steps, (lambda: self._estimate_graph_bytes(
            runner, sizes)) if sizes else None)
        bytes_per_block = runner.kv_cache_bytes_per_block()
        num_blocks = num_kv_blocks_for_utilization(
            memory, cache.gpu_memory_utilization, bytes_per_block // cache.block_size,
            cache.block_size)
        logger.info("GPU memory at --gpu-memory-utilization %s of %.2f GiB: %s; KV cache "
                    "%.2f GiB (profiled %d dummy steps of up to %d tokens in %.1f s)",
                    cache.gpu_memory_utilization, memory.total_bytes / _GIB,
                    memory.describe(), num_blocks * bytes_per_block / _GIB, len(steps),
                    scheduler.max_num_batched_tokens, time.perf_counter() - started)
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int | None = None) -> int:
        """Allocate the KV cache once, `num_blocks` (the ranks' agreed count) or what the
        budget holds; returns its blocks. An embedding model has no KV cache: 0 blocks,
        nothing allocated.
        """
        runner = self._require_runner()
        if isinstance(runner, PoolingModelRunner):
            logger.info("KV cache: none (the encoder sees each prompt whole in one step)")
            return 0
        if num_blocks is None:
            num_blocks = self.num_kv_blocks_in_budget()
        bytes_per_block = runner.kv_cache_bytes_per_block()
        runner.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks,
                    self.config.cache.block_size, num_blocks * bytes_per_block / _GIB)
        if self.device_type == "cuda":
            self._capture_graphs(runner)
        return num_blocks

    @torch.inference_mode()
    def _capture_graphs(self, runner: ModelRunner) -> None:
        """Warm the kernels up and capture the decode steps' CUDA graphs (cuda_graphs.py),
        now that the KV cache they read is allocated."""
        assert self.device is not None
        sizes, why_not = self._graph_sizes(runner)
        if not sizes:
            logger.info("CUDA graphs: none (%s); decode steps run eagerly", why_not)
            return
        cuda_graphs.start_graphs(runner, sizes, min(
            self.config.scheduler.max_num_batched_tokens, self.max_model_len))

    def _graph_sizes(self, runner: ModelRunner) -> tuple[list[int], str]:
        assert self.device is not None
        return cuda_graphs.graph_sizes(
            self.config.compilation, self.config.scheduler.max_num_seqs, self.device.type,
            runner.triton_attention, 1 if self.tp is None else self.tp.size)

    def _static_inputs(self, runner: ModelRunner, sizes: list[int]) -> cuda_graphs.StaticInputs:
        assert self.device is not None
        return cuda_graphs.StaticInputs(sizes[-1], runner.batch.block_table.shape[1],
                                        runner.block_size, runner.max_model_len, self.device)

    @torch.inference_mode()
    def _estimate_graph_bytes(self, runner: ModelRunner, sizes: list[int]) -> int:
        """The graphs' memory, from one capture on the profiling KV cache."""
        assert self.device is not None
        return cuda_graphs.estimate_on_cuda(
            cuda_graphs.model_forward(runner.model, runner.kv_caches), sizes,
            self._static_inputs(runner, sizes), self.device)

    # ------------------------------------------------------------------ steps
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._require_runner().execute_model(scheduler_output)

    def plugin_report(self) -> list[dict[str, Any]]:
        return load_report().to_dicts()

    # ------------------------------------------------------------------ what it serves
    @property
    def supported_tasks(self) -> tuple[str, ...]:
        info = self._require_info()
        model = self.model_runner.model if self.model_runner else None
        return tuple(getattr(model, "supported_tasks", None) or info.supported_tasks)

    @property
    def max_model_len(self) -> int:
        return int(self.config.model.max_model_len or self._require_info().max_model_len)

    @property
    def vocab_size(self) -> int:
        return self._require_info().vocab_size

    @property
    def device_type(self) -> str:
        """The torch device type this worker runs on ("cpu", "cuda"), after init_device."""
        assert self.device is not None, "init_device first"
        return self.device.type

    def _check_max_model_len(self, info: ModelInfo) -> None:
        wanted = self.config.model.max_model_len
        if wanted is not None and not 0 < wanted <= info.max_model_len:
            raise ValueError(f"max_model_len {wanted} must be between 1 and the model's "
                             f"context length {info.max_model_len}")

    def _require_info(self) -> ModelInfo:
        if self.info is None:
            raise RuntimeError("Worker.init_device() has not run")
        return self.info

    def _require_device(self) -> tuple[ModelInfo, torch.device, torch.dtype]:
        info = self._require_info()
        assert self.device is not None and self.dtype is not None
        return info, self.device, self.dtype

    def _require_runner(self) -> ModelRunner | PoolingModelRunner:
        if self.model_runner is None:
            raise RuntimeError("Worker.load_model() has not run")
        return self.model_runner



def _vocab(path: Path) -> dict[str, int]:
    """A model's tokenizer as token -> id (added tokens included)."""
    return dict(load_tokenizer(path).tokenizer.get_vocab(with_added_tokens=True))
