"""The flags of `gateway serve` (vLLM's names), and the `ServerConfig` (with its
`EngineConfig`) they make: parsed in the process `gateway serve` runs in, before it
becomes an API server or a supervisor.

The flags come in groups, each added by one function below and shown together by
`--help`: HTTP server (TLS, logs, tracing), engine (model, dtype, quantization, batch and
cache sizes, scheduling policy, prefix caching: on, as in vLLM), parallelism (tensor,
data, nodes, `--headless`), reliability (docs/reliability.md), tool calling. --host
defaults to 127.0.0.1, loopback only, unlike vLLM's every-interface default (0.0.0.0
exposes it, e.g. in a container); `--api-server-count`: docs/scaling.md.
"""

from __future__ import annotations

import argparse
import re
from importlib.util import find_spec

from gateway import envs
from gateway.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from gateway.frontend.cli.arg_types import byte_count, fraction_of_one, int_at_least
from gateway.frontend.engine_client.liveness import DEFAULT_STALL_THRESHOLD_S
from gateway.frontend.http.connections import DEFAULT_HEADER_TIMEOUT_S
from gateway.frontend.http.middleware import DEFAULT_MAX_BODY_BYTES
from gateway.frontend.openai.chat_parsers import add_chat_parser_args
from gateway.frontend.openai.cli_args import add_openai_args, structured_outputs_config
from gateway.frontend.openai.lora import LoRAModule, parse_lora_module
from gateway.frontend.openai.sampling import SEQS_PER_REQUEST_PER_BATCH_SEQ
from gateway.frontend.openai.structured_output_limits import SpecLimits
from gateway.frontend.server_config import (
    DEFAULT_LOOP_STALL_THRESHOLD_S,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_TIMEOUT_KEEP_ALIVE_S,
    HttpConfig,
    ObservabilityConfig,
    OpenAIConfig,
    ReliabilityConfig,
    ServerConfig,
)

DTYPES = {"auto": "auto", "float32": "float32", "float": "float32", "bfloat16": "bfloat16",
          "float16": "float16", "half": "float16"}
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DEFAULT_MAX_QUEUE_TIME_S = 60.0  # no client waits minutes in silence for its first token
_UNITS = {"": 1024 ** 3, "k": 1000, "ki": 1024, "m": 1000 ** 2, "mi": 1024 ** 2,
          "g": 1000 ** 3, "gi": 1024 ** 3, "t": 1000 ** 4, "ti": 1024 ** 4}
_SIZE_RE = re.compile(r"^\s*(?P<num>\d+(\.\d*)?|\.\d+)\s*(?P<unit>[kmgt]i?)?b?\s*$", re.IGNORECASE)


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every `gateway serve` flag to `parser`."""
    parser.add_argument("model", nargs="?", default=None,
                        help="a .gguf file, an HF folder (config.json, safetensors, "
                        "tokenizer.json), or a Hugging Face repo id (org/name, "
                        "org/name:QUANT for a GGUF repo's quantisation) from the HF cache, "
                        "downloaded if missing; omitted: the embedded default model "
                        "(SmolLM2-135M-Instruct)")
    parser.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                        help="the same as the positional MODEL (vLLM's older spelling)")
    _add_http_args(parser.add_argument_group("HTTP server"))
    _add_engine_args(parser.add_argument_group("engine"))
    _add_reliability_args(parser.add_argument_group("reliability (health, load, drain)"))
    _add_lora_args(parser.add_argument_group("LoRA adapters"))
    add_openai_args(parser)
    add_chat_parser_args(parser.add_argument_group("tool calling and reasoning"))
    return parser


def _add_http_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1, loopback only; use 0.0.0.0 "
                       "to listen on every interface)")
    group.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health, "
                       "/ping, /version and /metrics (default: VLLM_API_KEY, else no key)")
    group.add_argument("--root-path", default="",
                       help="the path prefix a reverse proxy serves the app under")
    group.add_argument("--disable-fastapi-docs", action="store_true",
                       help="serve no /docs, /redoc or /openapi.json")
    group.add_argument("--protect-metrics", action="store_true",
                       help="require the API key on /metrics too")
    group.add_argument("--max-request-body-bytes", type=_positive_int,
                       default=DEFAULT_MAX_BODY_BYTES,
                       help="answer 413 to a larger request body (default 16 MiB)")
    group.add_argument("--timeout-keep-alive", type=_positive_int,
                       default=envs.http_timeout_keep_alive() or DEFAULT_TIMEOUT_KEEP_ALIVE_S,
                       metavar="SECONDS",
                       help="close an idle keep-alive connection after this long (default: "
                       f"VLLM_HTTP_TIMEOUT_KEEP_ALIVE, else {DEFAULT_TIMEOUT_KEEP_ALIVE_S}); "
                       "keep it above the idle timeout of the clients and proxies in front")
    group.add_argument("--header-timeout", type=_positive_float,
                       default=DEFAULT_HEADER_TIMEOUT_S, metavar="SECONDS",
                       help="close a connection whose request headers are not complete this "
                       "long after they started, with a 408 "
                       f"(default {DEFAULT_HEADER_TIMEOUT_S:.0f})")
    group.add_argument("--limit-concurrency", type=_positive_int, default=None, metavar="N",
                       help="answer 503 with Retry-After to a request beyond N in progress "
                       "at once (streams included; /health, /ping, /metrics, /load and "
                       "/version are never refused); default: no limit")
    group.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS)
    group.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="do not log each request")
    _add_tls_args(group)
    _add_log_args(group)
    group.add_argument("--otlp-traces-endpoint", default=envs.otlp_traces_endpoint(),
                       metavar="URL",
                       help="send OpenTelemetry traces over OTLP/HTTP to this URL, e.g. "
                       "http://collector:4318/v1/traces (default: "
                       "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; unset: no tracing, and the "
                       "OpenTelemetry SDK is not imported)")


def _add_reliability_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--max-num-queued-reqs", type=_positive_int, default=None, metavar="N",
                       help="answer 503 with Retry-After to a generation or embedding "
                       "request beyond N in the engine, waiting and running together (a "
                       "request with n > 1 counts n); default: no limit")
    group.add_argument("--max-queue-time", type=_non_negative_float,
                       default=DEFAULT_MAX_QUEUE_TIME_S, metavar="SECONDS",
                       help="answer 503 with Retry-After to a request that waited this long "
                       "in the engine's queue without starting; one that started is never "
                       f"dropped (default {DEFAULT_MAX_QUEUE_TIME_S:.0f}; 0: no limit)")
    group.add_argument("--engine-stall-threshold", type=_positive_float,
                       default=DEFAULT_STALL_THRESHOLD_S, metavar="SECONDS",
                       help="with requests pending and no engine step completed for this "
                       "long, /health answers 503 and gateway_engine_stalled is 1 until "
                       f"steps resume (default {DEFAULT_STALL_THRESHOLD_S:.0f})")
    group.add_argument("--event-loop-stall-threshold", type=_positive_float,
                       default=DEFAULT_LOOP_STALL_THRESHOLD_S, metavar="SECONDS",
                       help="log a WARNING naming the request when the front end's event "
                       "loop is blocked longer than this (default "
                       f"{DEFAULT_LOOP_STALL_THRESHOLD_S})")
    group.add_argument("--plugin-route-timeout", type=_positive_float, default=None,
                       metavar="SECONDS",
                       help="answer 504 to an endpoint-plugin request that has not started "
                       "its response after this long (it frees the client; it cannot stop "
                       "code that blocks); default: no limit")
    group.add_argument("--shutdown-timeout", type=_non_negative_float,
                       default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
                       help="on SIGTERM, requests in progress get this long to finish; "
                       "then streams end with an error event and [DONE] (default "
                       f"{DEFAULT_SHUTDOWN_TIMEOUT_S:.0f}; 0: at once)")


def _add_tls_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                       help="serve HTTPS with this private key (PEM)")
    group.add_argument("--ssl-certfile", default=None, metavar="FILE",
                       help="serve HTTPS with this certificate chain (PEM)")
    group.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                       help="CA certificates (PEM) that client certificates are checked "
                       "against (mutual TLS with --ssl-cert-reqs 2)")
    group.add_argument("--ssl-cert-reqs", type=int, choices=(0, 1, 2), default=0,
                       help="client certificates: 0 not asked (default), 1 checked when "
                       "sent, 2 required (Python's ssl.CERT_NONE/OPTIONAL/REQUIRED)")


def _add_log_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--enable-log-requests", action="store_true",
                       help="log each request's prompt (cut to --max-log-len) and "
                       "sampling parameters at INFO")
    group.add_argument("--enable-log-outputs", action="store_true",
                       help="also log each finished request's output text and token counts")
    group.add_argument("--max-log-len", type=_non_negative_int, default=None, metavar="N",
                       help="logged prompts and outputs keep their first N characters and "
                       "token ids (default: all)")
    group.add_argument("--log-format", choices=("text", "json"), default=envs.log_format(),
                       help="text lines (default), or one JSON object per line for log "
                       "shippers, in every process of the server (also GATEWAY_LOG_FORMAT)")


def _add_engine_args(group: argparse._ArgumentGroup) -> None:
    model, cache, scheduler = ModelConfig(), CacheConfig(), SchedulerConfig()
    group.add_argument("--served-model-name", default=None,
                       help="the model name clients send and /v1/models shows")
    group.add_argument("--revision", default=None,
                       help="the branch, tag or commit of a Hugging Face repo-id model "
                       "(default main)")
    group.add_argument("--download-dir", default=None, metavar="DIR",
                       help="the Hugging Face cache a repo-id model is looked up in and "
                       "downloaded to (default: HF_HUB_CACHE, else HF_HOME/hub)")
    group.add_argument("--dtype", default=model.dtype, choices=sorted(DTYPES),
                       help="weights and activations dtype (auto: bfloat16 where the CPU "
                       "has it, else float32)")
    group.add_argument("--quantization", "-q", default=None, choices=("gguf", "none"),
                       help="gguf: keep a GGUF file's Q4_0/Q4_1/Q8_0, Q5_0/Q5_1 and "
                       "K-quant (Q4_K/Q5_K/Q6_K) weights quantized "
                       "(--dtype is then the activations'); none: dequantize them at load. "
                       "Default: gguf for a GGUF file on the CPU where the gateway's float32 "
                       "kernels build (a C compiler), else none")
    group.add_argument("--max-model-len", type=_positive_int, default=None,
                       help="context length (prompt + completion); default: the model's")
    group.add_argument("--max-num-seqs", type=_positive_int, default=scheduler.max_num_seqs,
                       help="cap on sequences running at once")
    group.add_argument("--max-num-batched-tokens", type=_positive_int,
                       default=scheduler.max_num_batched_tokens,
                       help="token budget per engine step")
    group.add_argument("--max-num-prefill-tokens", type=_positive_int,
                       default=scheduler.max_num_prefill_tokens,
                       help="prompt tokens one engine step may take while other requests run "
                       "or wait (decoding rows are not counted; a request alone gets the "
                       "whole budget); default: 256 on the CPU, where a burst of prompts "
                       "then gets its first tokens sooner at the same throughput, and the "
                       "whole budget on a GPU")
    group.add_argument("--scheduling-policy", choices=("fcfs", "priority"),
                       default=scheduler.policy,
                       help="fcfs: requests start in arrival order; priority: by each "
                       "request's `priority` (lower first, then arrival), and under memory "
                       "pressure the lowest priority is preempted first")
    group.add_argument("--async-scheduling", action="store_true",
                       default=scheduler.async_scheduling,
                       help="schedule the next engine step while the worker runs the current "
                       "one (vLLM's flag; off by default): same outputs, the scheduler's time "
                       "hidden behind the model's; ignored for pooling models")
    group.add_argument("--gpu-memory-utilization", type=fraction_of_one,
                       default=cache.gpu_memory_utilization, metavar="FRACTION",
                       help="share of a CUDA device's total memory for the weights, the "
                       "activation peak of a --max-num-batched-tokens step and the KV cache, "
                       "which gets what is left (default 0.9); not used on the CPU")
    group.add_argument("--kv-cache-memory-bytes", type=byte_count, default=None,
                       metavar="BYTES",
                       help="KV-cache budget per worker, in bytes (1G or 1GiB: 2**30; 1g: "
                       "10**9); on a CUDA device it replaces --gpu-memory-utilization's "
                       "sizing (default: that sizing; 1 GiB on the CPU)")
    group.add_argument("--kv-cache-memory", type=_gib_as_bytes,
                       dest="kv_cache_memory_bytes", metavar="SIZE",
                       help="--kv-cache-memory-bytes as a number of GiB, or a size with a "
                       "unit (512MiB, 2GiB; 1G is 10**9 bytes)")
    group.add_argument("--block-size", type=_positive_int, default=cache.block_size,
                       help="tokens per KV-cache block")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=cache.enable_prefix_caching,
                       help="reuse the KV cache of a prompt's leading full blocks computed "
                       "for an earlier request (default on)")
    group.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
                       help="worker processes (ranks) the model is split across")
    group.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=1,
                       help="engine cores, each with a whole copy of the model and its own "
                       "--tensor-parallel-size ranks; requests go to the least loaded")
    group.add_argument("--data-parallel-backend", "-dpb", choices=("mp", "ray"), default="mp",
                       help="how the data-parallel engine cores are started: mp, local "
                       "processes; ray, Ray actors placed by the cluster RAY_ADDRESS names "
                       "(or a local one), reached over TCP (pip install 'gateway[ray]')")
    group.add_argument("--data-parallel-address", "-dpa", default=None,
                       help="with --data-parallel-backend ray: the address of this machine "
                       "that the engine actors reach the front end at (default: this node's "
                       "address as the Ray cluster knows it)")
    _add_parallel_args(group)
    _add_graph_args(group)
    group.add_argument("--seed", type=int, default=model.seed, help="engine random seed")
    group.add_argument("--io-processor-plugin", default=None,
                       help="name of the vllm.io_processor_plugins entry point to use")
    group.add_argument("--logits-processors", nargs="+", action="extend", default=[],
                       type=_qualname, metavar="MODULE:CLASS",
                       help="extra logits processors by qualified name (repeatable)")
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       type=_speculative_config,
                       help="speculative decoding, vLLM's JSON: n-gram prompt lookup "
                       "'{\"method\": \"ngram\", \"num_speculative_tokens\": 5, "
                       "\"prompt_lookup_max\": 5, \"prompt_lookup_min\": 2}', or a draft "
                       "model of the same vocabulary and tokenizer '{\"model\": "
                       "\"PATH_OR_ID\", \"num_speculative_tokens\": 4}' (method "
                       "\"draft_model\"; one rank only)")
    group.add_argument("--disable-log-stats", action="store_true",
                       help="do not log engine stats periodically (metrics and plugin stat "
                            "loggers still run)")


def _add_graph_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--enforce-eager", action="store_true",
                       help="capture no CUDA graphs: every step runs eagerly (on a CUDA "
                       "device, decode steps otherwise replay graphs captured at start-up)")
    group.add_argument("--max-cudagraph-capture-size", type=_positive_int, default=None,
                       metavar="N",
                       help="the largest decode batch captured as a CUDA graph (default 512, "
                       "never above --max-num-seqs); larger batches run eagerly")
    group.add_argument("--cudagraph-capture-sizes", type=_positive_int, nargs="+",
                       default=None, metavar="N",
                       help="the decode batch sizes captured as CUDA graphs (default: 1, 2, "
                       "4, every 8 below 256, every 16 from 256, up to the largest)")
    group.add_argument("--cuda-graph-sizes", type=_positive_int, nargs="+", default=None,
                       metavar="N",
                       help="vLLM's older flag: one value is --max-cudagraph-capture-size, "
                       "several are --cudagraph-capture-sizes")


def _compilation_config(args: argparse.Namespace) -> CompilationConfig:
    sizes, largest = args.cudagraph_capture_sizes, args.max_cudagraph_capture_size
    if args.cuda_graph_sizes is not None:
        if sizes is not None or largest is not None:
            raise ValueError("--cuda-graph-sizes (vLLM's older flag) with "
                             "--cudagraph-capture-sizes or --max-cudagraph-capture-size: "
                             "give only the newer flags")
        if len(args.cuda_graph_sizes) == 1:
            largest = args.cuda_graph_sizes[0]
        else:
            sizes = args.cuda_graph_sizes
    config = CompilationConfig(enforce_eager=args.enforce_eager,
                               max_cudagraph_capture_size=largest,
                               cudagraph_capture_sizes=None if sizes is None
                               else sorted(set(sizes)))
    config.validate()
    return config


def _add_lora_args(group: argparse._ArgumentGroup) -> None:
    lora = LoRAConfig()
    group.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters: a request names one in `model`")
    group.add_argument("--lora-modules", nargs="+", action="extend", default=[],
                       type=_lora_module, metavar="NAME=PATH|JSON",
                       help="adapters served from start-up: name=path, or JSON "
                       "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' "
                       "(repeatable)")
    group.add_argument("--max-loras", type=_positive_int, default=lora.max_loras,
                       help="distinct adapters one engine step may run (default 1)")
    group.add_argument("--max-lora-rank", type=_positive_int, default=lora.max_lora_rank,
                       help="the largest adapter rank served (default 16)")
    group.add_argument("--max-cpu-loras", type=_positive_int, default=None,
                       help="adapters each worker keeps read in host memory, least "
                       "recently used out (default: --max-loras)")


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _lora_module(text: str) -> LoRAModule:
    try:
        return parse_lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _lora_config(args: argparse.Namespace) -> LoRAConfig | None:
    if not args.enable_lora:
        if args.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    config = LoRAConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                        max_cpu_loras=args.max_cpu_loras)
    config.validate()
    return config


def _add_parallel_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--nnodes", type=_positive_int, default=1,
                       help="nodes (hosts) the ranks run on; each runs --tensor-parallel-size "
                       "/ --nnodes of them")
    group.add_argument("--node-rank", type=int, default=0,
                       help="this node's index, 0 (the server) to nnodes - 1 (--headless)")
    group.add_argument("--master-addr", default="127.0.0.1",
                       help="address of node 0, where rank 0 serves the rendezvous "
                       "(torch.distributed TCP store)")
    group.add_argument("--master-port", type=_positive_int, default=None,
                       help="port of the rendezvous (default: a free port; several nodes: "
                       "required)")
    group.add_argument("--api-server-count", "-asc", type=_positive_int, default=1,
                       help="API-server (HTTP front-end) processes sharing the port, all "
                       "connected to the engine core; more than 1 adds a supervisor process "
                       "(see docs/scaling.md)")
    group.add_argument("--headless", action="store_true",
                       help="run only this node's worker ranks (no HTTP server, no engine "
                       "core); with --node-rank >= 1")
    group.add_argument("--distributed-executor-backend", choices=("uni", "mp", "ray"),
                       default=None,
                       help="uni: the worker inside the engine-core process; mp: one worker "
                       "process per rank; ray: one Ray actor per rank, on the cluster "
                       "RAY_ADDRESS names or a local one (pip install 'gateway[ray]') "
                       "(default: uni for one rank, mp for more)")


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The whole server's configuration, read once from the parsed flags; ValueError
    naming the bad value."""
    return ServerConfig(
        engine=engine_config_from_args(args),
        http=HttpConfig(
            host=args.host, port=args.port, root_path=args.root_path,
            api_key=args.api_key or envs.api_key() or None,
            disable_fastapi_docs=args.disable_fastapi_docs,
            protect_metrics=args.protect_metrics,
            max_request_body_bytes=args.max_request_body_bytes,
            limit_concurrency=args.limit_concurrency,
            timeout_keep_alive_s=args.timeout_keep_alive,
            header_timeout_s=args.header_timeout, uvicorn_log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            allowed_origins=tuple(args.allowed_origins),
            allowed_methods=tuple(args.allowed_methods),
            allowed_headers=tuple(args.allowed_headers),
            allow_credentials=args.allow_credentials, ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs),
        reliability=ReliabilityConfig(
            max_num_queued_reqs=args.max_num_queued_reqs,
            engine_stall_threshold_s=args.engine_stall_threshold,
            event_loop_stall_threshold_s=args.event_loop_stall_threshold,
            plugin_route_timeout_s=args.plugin_route_timeout,
            shutdown_timeout_s=args.shutdown_timeout),
        openai=OpenAIConfig(
            max_n=args.max_n, generation_config=args.generation_config,
            max_seqs_per_request=args.max_seqs_per_request
            or SEQS_PER_REQUEST_PER_BATCH_SEQ * args.max_num_seqs,
            chat_template=args.chat_template,
            trust_request_chat_template=args.trust_request_chat_template,
            chat_template_render_timeout_s=args.chat_template_render_timeout or None,
            spec_limits=SpecLimits(max_bytes=args.structured_outputs_max_bytes,
                                   max_enum_values=args.structured_outputs_max_enum_values,
                                   max_depth=args.structured_outputs_max_depth),
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser, tool_parser_plugin=args.tool_parser_plugin,
            reasoning_parser=args.reasoning_parser,
            responses_store_max_entries=args.responses_store_max_entries,
            responses_store_max_age_s=args.responses_store_max_age,
            lora_modules=tuple(args.lora_modules)),
        observability=ObservabilityConfig(
            log_format=args.log_format, enable_log_requests=args.enable_log_requests,
            enable_log_outputs=args.enable_log_outputs, max_log_len=args.max_log_len,
            disable_log_stats=args.disable_log_stats,
            otlp_traces_endpoint=args.otlp_traces_endpoint),
        api_server_count=args.api_server_count, headless=args.headless, args=args)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration `gateway serve` runs with."""
    if args.model and args.model_option and args.model != args.model_option:
        raise ValueError(f"two models given: {args.model!r} and --model "
                         f"{args.model_option!r}")
    if args.async_scheduling and args.speculative_config is not None:
        raise ValueError("--async-scheduling and --speculative-config cannot be combined "
                         "yet: drop one of them")
    if (args.speculative_config is not None and args.speculative_config.uses_draft_model
            and args.tensor_parallel_size > 1):
        raise ValueError(f"--speculative-config: field 'model': a draft model with "
                         f"--tensor-parallel-size {args.tensor_parallel_size} is not "
                         "supported (the draft runs unsplit); use \"method\": \"ngram\" or "
                         "one rank")
    return EngineConfig(
        model=ModelConfig(
            model=args.model or args.model_option, served_model_name=args.served_model_name,
            revision=args.revision, download_dir=args.download_dir,
            dtype=DTYPES[args.dtype], max_model_len=args.max_model_len, seed=args.seed,
            quantization=args.quantization,
            io_processor_plugin=args.io_processor_plugin,
            logits_processors=list(args.logits_processors)),
        cache=CacheConfig(block_size=args.block_size,
                          kv_cache_memory_gib=_bytes_as_gib(args.kv_cache_memory_bytes),
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=args.enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_prefill_tokens=args.max_num_prefill_tokens,
                                  max_queue_time=args.max_queue_time or None,
                                  policy=args.scheduling_policy,
                                  async_scheduling=args.async_scheduling),
        parallel=_parallel_config(args),
        structured_outputs=structured_outputs_config(args),
        compilation=_compilation_config(args),
        lora=_lora_config(args),
        speculative=args.speculative_config,
    )


def _parallel_config(args: argparse.Namespace) -> ParallelConfig:
    parallel = ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size, nnodes=args.nnodes,
        node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
        distributed_executor_backend=args.distributed_executor_backend,
        data_parallel_size=args.data_parallel_size,
        data_parallel_backend=args.data_parallel_backend,
        data_parallel_address=args.data_parallel_address)
    parallel.validate()
    if args.headless and args.api_server_count > 1:
        raise ValueError("--headless runs no API server: drop --api-server-count")
    backends = {"--distributed-executor-backend": parallel.distributed_executor_backend,
                "--data-parallel-backend": parallel.data_parallel_backend}
    for flag, backend in backends.items():
        if backend == "ray" and find_spec("ray") is None:
            raise ValueError(f"{flag} ray needs Ray: pip install 'gateway[ray]'")
    if args.headless and parallel.node_rank == 0:
        raise ValueError("--headless runs the worker ranks of another node than the "
                         "server's: give it --node-rank 1 or more")
    if not args.headless and parallel.node_rank != 0:
        raise ValueError(f"--node-rank {parallel.node_rank} runs only worker ranks: add "
                         "--headless (node 0 runs the server)")
    return parallel


def parse_memory_gib(text: str) -> float:
    """A memory size in GiB: '1' and '1.5' are GiB; '512MiB', '2GiB' and '1G' carry their unit."""
    match = _SIZE_RE.match(text)
    if match is None:
        try:
            value = float(text)  # plain numbers in any float spelling are GiB
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid size {text!r}: give GiB (1.5) or a size with a unit (512MiB)"
            ) from None
        size = value
    else:
        unit = (match.group("unit") or "").lower()
        size = float(match.group("num")) * _UNITS[unit] / 1024 ** 3
    if size <= 0:
        raise argparse.ArgumentTypeError(f"the size must be positive, got {text!r}")
    return size


def _gib_as_bytes(text: str) -> int:
    return round(parse_memory_gib(text) * 1024 ** 3)


def _bytes_as_gib(num_bytes: int | None) -> float | None:
    return None if num_bytes is None else num_bytes / 1024 ** 3


_positive_int = int_at_least(1)
_non_negative_int = int_at_least(0)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _qualname(text: str) -> str:
    """'module:Class', also accepting vLLM's 'module.Class'."""
    if ":" not in text:
        module, _, cls = text.rpartition(".")
        text = f"{module}:{cls}" if module else text
    module, _, cls = text.partition(":")
    if not module or not cls:
        raise argparse.ArgumentTypeError(f"expected MODULE:CLASS, got {text!r}")
    return text
