"""Every environment variable the gateway reads, in one place.

Values are read when asked for (not at import), so a test or a parent process can change
the environment before a child reads it.
"""

from __future__ import annotations

import os


def vllm_plugins() -> list[str] | None:
    """VLLM_PLUGINS as a list of entry-point names, or None when unset.

    Names are stripped of surrounding spaces; empty items are dropped, except that the
    empty string as a whole is a list holding the empty name: it allows nothing.
    """
    raw = os.environ.get("VLLM_PLUGINS")
    if raw is None:
        return None
    names = [name.strip() for name in raw.split(",")]
    kept = [name for name in names if name]
    return kept if kept else [""]


def target_device() -> str | None:
    """VLLM_TARGET_DEVICE, lower-cased: 'cpu' selects the CPU platform; any other value
    (vLLM's default is 'cuda') or none detects the platform."""
    value = os.environ.get("VLLM_TARGET_DEVICE", "").strip().lower()
    return value or None


def logging_level() -> str:
    """VLLM_LOGGING_LEVEL: the gateway's log level (default INFO)."""
    return os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()


def log_format() -> str:
    """GATEWAY_LOG_FORMAT: `text` (default) or `json` (one object per line), in every
    process; `gateway serve --log-format` sets it for the processes it starts."""
    value = os.environ.get("GATEWAY_LOG_FORMAT", "text").strip().lower()
    return value if value in ("text", "json") else "text"


def otlp_traces_endpoint() -> str | None:
    """OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: where traces go (OTLP/HTTP); unset: no tracing."""
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None


def api_key() -> str | None:
    """VLLM_API_KEY: the bearer token every non-public route requires."""
    return os.environ.get("VLLM_API_KEY") or None


def http_timeout_keep_alive() -> str | None:
    """VLLM_HTTP_TIMEOUT_KEEP_ALIVE (vLLM's name): seconds an idle HTTP keep-alive
    connection stays open; the raw text (the CLI validates it), or None when unset."""
    return os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE") or None


def process_role() -> str | None:
    """GATEWAY_PROCESS_ROLE: set by the gateway for the processes it spawns."""
    return os.environ.get("GATEWAY_PROCESS_ROLE") or None


def prometheus_multiproc_dir() -> str | None:
    """PROMETHEUS_MULTIPROC_DIR: prometheus_client's multiprocess mode (metric values in
    files in this folder, summed over processes at scrape time). prometheus_client reads it
    when first imported, so it must be set before the server starts."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def cpu_reserved_cores() -> str | None:
    """VLLM_CPU_NUM_OF_RESERVED_CPU (vLLM's name): cores a CPU worker leaves to the rest
    (front end, client); the raw text (worker/cpu_threads.py validates it), None unset."""
    return os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "").strip() or None


def cpu_threads_bind() -> str:
    """VLLM_CPU_OMP_THREADS_BIND (vLLM's name): `auto` (default), `nobind`, or core lists
    such as `0-3|4-7` (one per rank on this machine)."""
    return os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "").strip() or "auto"


#: How long (libgomp's spin count) an OpenMP thread of the engine core or a worker waits
#: spinning before it sleeps, where the operator set neither OMP_WAIT_POLICY nor it.
DEFAULT_GOMP_SPINCOUNT = "20000"


def default_openmp_waiting() -> None:
    """Before torch loads, in the engine core and in each worker: OpenMP's threads wait
    passively (OMP_WAIT_POLICY=PASSIVE), after a short spin (GOMP_SPINCOUNT=20000), unless
    the operator set OMP_WAIT_POLICY. Spinning for good stalls a step for whole time
    slices when the front end or the client takes a core; sleeping at once makes each of
    the hundreds of parallel regions of a many-row step, microseconds apart, wake its
    threads again. The short spin keeps them awake within a step and asleep between steps
    (docs/cpu-performance.md has the measurements)."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.environ.setdefault("GOMP_SPINCOUNT", DEFAULT_GOMP_SPINCOUNT)


def cpu_single_row_weights() -> bool:
    """GATEWAY_CPU_SINGLE_ROW_WEIGHTS: `1` (default) keeps each float32 or bfloat16 linear
    layer's weight, transposed, beside its oneDNN-packed one, for single-row inputs (batch-1
    decode); `0` drops it (less memory, slower batch-1 steps)."""
    return os.environ.get("GATEWAY_CPU_SINGLE_ROW_WEIGHTS", "1").strip() != "0"


def cpu_quant_kernels() -> bool:
    """GATEWAY_CPU_QUANT_KERNELS: `1` (default) builds the gateway's float32 kernels for
    quantized GGUF weights with the C compiler at first use; `0` uses torch's int4 kernel."""
    return os.environ.get("GATEWAY_CPU_QUANT_KERNELS", "1").strip() != "0"


def cpu_int8_activations() -> bool:
    """GATEWAY_CPU_INT8_ACTIVATIONS: `1` multiplies rows of activations quantized to 8 bits
    with Q4_0, Q4_1 and Q8_0 weights (a scale a group of 32 columns) and with Q4_K, Q5_K and
    Q6_K weights in their file's blocks (a scale a block of 256) in the CPU kernels (integer
    dot products); `0` (default: on the default model they change some greedy tokens,
    docs/quantization.md) keeps the exact float32 products."""
    return os.environ.get("GATEWAY_CPU_INT8_ACTIVATIONS", "0").strip() == "1"


def cpu_lone_decode() -> bool:
    """GATEWAY_CPU_LONE_DECODE: `1` (default) runs a lone decode step in one C call where
    the model's shape and weights allow it (models/kernels/cpu/lone_decode.py); `0` runs it
    through torch."""
    return os.environ.get("GATEWAY_CPU_LONE_DECODE", "1").strip() != "0"


def cpu_verify_one_thread() -> bool:
    """GATEWAY_CPU_VERIFY_ONE_THREAD: `0` (default) gives a step verifying speculative
    drafts through the torch forward (several sequences, or a model the one C call does not
    serve) every thread (faster on a CPU the server has to itself); `1` runs a short one on
    one thread as a lone decode step runs (quantized CPU weights): better only on a CPU
    shared with other busy processes (docs/speculative-decoding.md). A lone sequence's
    verifying step in the one C call always runs as a lone decode step does."""
    return os.environ.get("GATEWAY_CPU_VERIFY_ONE_THREAD", "0").strip() == "1"


def cpu_isa_cap() -> str | None:
    """GATEWAY_CPU_ISA: the highest CPU instruction-set level the gateway's own kernels and
    path choices may use (`baseline`, `avx2`, `avx512`, `avx512_bf16`, `amx`; unset or
    `native`: the CPU's own); the raw text (platforms/cpu_isa.py validates it)."""
    return os.environ.get("GATEWAY_CPU_ISA") or None


def attention_backend() -> str:
    """GATEWAY_ATTENTION_BACKEND: `auto` (default: the Triton kernels on a CUDA device where
    Triton imports, torch's ops elsewhere), `torch`, or `triton` (on any device: the CPU
    runs the kernels through Triton's interpreter when TRITON_INTERPRET=1, for tests);
    lower-cased (models/layers/triton_attention.py validates it)."""
    return os.environ.get("GATEWAY_ATTENTION_BACKEND", "").strip().lower() or "auto"


#: vLLM's default for VLLM_XGRAMMAR_CACHE_MB.
DEFAULT_XGRAMMAR_CACHE_MB = 512


def xgrammar_cache_mb() -> int:
    """VLLM_XGRAMMAR_CACHE_MB (vLLM's name): MiB of compiled grammars the engine core keeps
    (default 512); also the memory one grammar's compilation may take. A value that is not
    a positive whole number stops the engine core naming it."""
    raw = os.environ.get("VLLM_XGRAMMAR_CACHE_MB", "").strip()
    if not raw:
        return DEFAULT_XGRAMMAR_CACHE_MB
    if not raw.isdigit() or int(raw) <= 0:
        raise ValueError(f"VLLM_XGRAMMAR_CACHE_MB must be a positive number of MiB, got {raw!r}")
    return int(raw)


def allow_runtime_lora_updating() -> bool:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING (vLLM's): true or 1 attaches /v1/load_lora_adapter
    and /v1/unload_lora_adapter and lets LoRA resolvers find adapters by name."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in (
        "1", "true")


def lora_resolver_cache_dir() -> str | None:
    """VLLM_LORA_RESOLVER_CACHE_DIR (vLLM's): the folder the example filesystem resolver
    finds adapters in, one subfolder per adapter name."""
    return os.environ.get("VLLM_LORA_RESOLVER_CACHE_DIR") or None


DEFAULT_LORA_RESOLVER_TIMEOUT_S = 10.0


def lora_resolver_timeout_s() -> float:
    """GATEWAY_LORA_RESOLVER_TIMEOUT_S: how long one LoRA resolver may take to answer
    (default 10 s); past it, the resolver is recorded as failed and the next is asked."""
    raw = os.environ.get("GATEWAY_LORA_RESOLVER_TIMEOUT_S", "").strip()
    try:
        value = float(raw) if raw else DEFAULT_LORA_RESOLVER_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"GATEWAY_LORA_RESOLVER_TIMEOUT_S must be a positive number of "
                         f"seconds, got {raw!r}")
    return value


def cache_dir() -> str:
    """GATEWAY_CACHE_DIR, else $XDG_CACHE_HOME/gateway, else ~/.cache/gateway: where built
    kernels are kept."""
    explicit = os.environ.get("GATEWAY_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gateway")


ALL = {
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true: /v1/load_lora_adapter and "
    "/v1/unload_lora_adapter are served, and LoRA resolver plugins find adapters by name",
    "VLLM_LORA_RESOLVER_CACHE_DIR": "the folder the example filesystem LoRA resolver reads "
    "adapters from (general_plugins/lora_filesystem_resolver)",
    "GATEWAY_LORA_RESOLVER_TIMEOUT_S": "seconds one LoRA resolver may take (default 10)",
    "VLLM_PLUGINS": "comma-separated entry-point names allowed to load; unset: all "
    "(endpoint plugins: none); empty: none",
    "VLLM_TARGET_DEVICE": "'cpu': use the CPU without detecting a platform; any other value "
    "(or unset): detect it",
    "VLLM_LOGGING_LEVEL": "log level of the gateway's loggers (default INFO)",
    "VLLM_API_KEY": "API key required by every non-public route (same as --api-key)",
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "seconds an idle HTTP keep-alive connection stays open "
    "(same as --timeout-keep-alive; default 75)",
    "GATEWAY_PROCESS_ROLE": "internal: the role of a process the gateway spawned",
    "GATEWAY_GC_STATS_DIR": "internal: where the processes the front end spawned keep their "
    "garbage-collector counts (python_gc_* metrics)",
    "OMP_WAIT_POLICY": "OpenMP's; where it is unset the engine core and the workers set it "
    "to PASSIVE and GOMP_SPINCOUNT to 20000 (threads spin briefly, then sleep: awake "
    "within a step, asleep between steps when cores are shared)",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "cores a CPU worker leaves free for the front end "
    "(default 0)",
    "VLLM_CPU_OMP_THREADS_BIND": "where a CPU worker's threads run: auto (default: the last "
    "cores, after the reserved ones), nobind, or core lists such as 0-3|4-7 (one per rank)",
    "GATEWAY_CPU_SINGLE_ROW_WEIGHTS": "1 (default): float32 linear layers keep their "
    "weight transposed beside the packed one, for batch-1 decode (faster, more memory); "
    "0: packed only",
    "GATEWAY_CPU_QUANT_KERNELS": "1 (default): quantized GGUF weights run with the "
    "gateway's float32 CPU kernels, built with the C compiler (cc, or $CC) at first use; "
    "0: with torch's int4 kernel (bfloat16)",
    "GATEWAY_CPU_INT8_ACTIVATIONS": "1: the CPU kernels multiply Q4_0, Q4_1 and Q8_0 "
    "weights with activations quantized to 8 bits a group of 32, and Q4_K, Q5_K and Q6_K "
    "weights (every part of the weight one of those) with activations quantized a block of "
    "256 (integer dot products, AVX2 or AVX-512 VNNI) in products of 4 to 256 rows; 0 "
    "(default): exact products",
    "GATEWAY_CPU_ISA": "caps the CPU instruction-set level the gateway's kernels and path "
    "choices see (baseline, avx2, avx512, avx512_bf16, amx; default native): run as an "
    "older CPU would",
    "GATEWAY_ATTENTION_BACKEND": "auto (default): Triton paged-attention kernels on a CUDA "
    "device where Triton imports, torch's ops elsewhere; torch or triton force one",
    "GATEWAY_CACHE_DIR": "where built kernels are kept (default $XDG_CACHE_HOME/gateway or "
    "~/.cache/gateway)",
    "VLLM_XGRAMMAR_CACHE_MB": "MiB of compiled grammars the engine core keeps (default "
    "512), and the most memory one grammar's compilation may take",
    "PROMETHEUS_MULTIPROC_DIR": "a folder for prometheus_client's multiprocess mode "
    "(set before start-up); unset: one process's metrics, in memory",
}
