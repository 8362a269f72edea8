"""The contracts a plugin author codes against, all in one file.

Names and shapes follow vLLM's, so a plugin that uses only FastAPI and these contracts
runs on both. Each member says when it is called and in which process; the guide,
docs/plugins.md, has a section per contract ("Contracts").
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

from gateway.lora_request import LoRARequest
from gateway.messages import EngineCoreOutputs
from gateway.outputs import PoolingRequestOutput, RequestOutput
from gateway.pooling_params import PoolingParams
from gateway.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch
    from fastapi import FastAPI

    from gateway.config import EngineConfig, ModelConfig
    from gateway.models.info.paths import ModelInfo
    from gateway.tokenizer import Tokenizer


# --------------------------------------------------------------------------- engine client
#: Called with every batch of outputs an engine core sends (`EngineCoreOutputs`).
OutputsListener = Callable[[EngineCoreOutputs], None]
#: Called with (request id, number of prompt tokens, params) as each request is sent.
RequestHook = Callable[[str, int, SamplingParams | PoolingParams], None]
#: Called with the reason ("queue_full", "queue_timeout") of each request refused for load.
RejectionListener = Callable[[str], None]


@runtime_checkable
class EngineClient(Protocol):
    """The server's handle on the engine (front-end process): what the core routes, the
    metrics and the reliability pieces use, and what `EndpointPlugin.init_state` receives as
    `engine_client`. One per API-server process, over one engine core or several
    (data parallel). Every member is used on the server's event loop. Guide: "EngineClient".
    """

    # What the engine core said at its handshake: fixed from start-up on.
    #: The served model's tokenizer: `encode(text)`, `decode(ids)`,
    #: `apply_chat_template(messages, add_generation_prompt=True)`, `eos_token_ids`.
    tokenizer: Tokenizer
    #: The name clients use in the `model` field.
    model_name: str
    #: The longest prompt plus output, in tokens, a request may have.
    max_model_len: int
    #: The tasks the model serves: "generate" (decoders), "embed" (encoders), "classify",
    #: "score".
    supported_tasks: tuple[str, ...]
    #: The whole engine configuration the server started with.
    config: EngineConfig
    #: The served model's files and config (torch-free), e.g. its path and labels.
    model_info: ModelInfo | None
    #: KV-cache blocks of each engine core.
    num_kv_blocks: int
    #: Whether the engine is gone (died, or shut down): every request then fails.
    is_dead: bool
    #: Why the engine is gone (None while it runs).
    dead_reason: str | None

    @property
    def model_config(self) -> ModelConfig:
        """The model's part of `config` (model path, dtype, seed, logits processors)."""
        ...

    @property
    def stalled_reason(self) -> str | None:
        """Why the engine makes no progress with requests pending (None: it does); read
        by /health and `gateway_engine_stalled` at each call."""
        ...

    @property
    def num_inflight_requests(self) -> int:
        """The requests this front end has in flight in the engine (/load)."""
        ...

    @property
    def process_pids(self) -> dict[str, int]:
        """The engine's processes on this host by role (engine core, workers): pid; read
        by the process metrics at each scrape."""
        ...

    @property
    def gc_stats_dirs(self) -> list[str]:
        """The folders where the engine's local processes keep their garbage-collector
        counts (`python_gc_*`), read at each scrape."""
        ...

    # Requests: called by the routes (and plugin routes) for each request.
    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Stream one request's outputs (an async generator, one `RequestOutput` per step
        with new tokens; the last has `finished` True). Stopping the iteration early
        (aclose, cancellation, a client that went away) aborts the request.
        `request_id` must be unique among requests in flight. Raises EngineDeadError when
        the engine is gone and RequestRejectedError when the server sheds load."""
        ...

    async def encode(self, prompt_token_ids: list[int], params: PoolingParams,
                     request_id: str) -> PoolingRequestOutput:
        """Pool one prompt (task "embed"); the result's `outputs.data` is the vector, or its
        `error` says why the engine failed it. Cancelling the call aborts the request."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request in flight; its stream ends with finish_reason "abort"."""
        ...

    def add_parent_request(self, child_request_ids: list[str]) -> None:
        """Say which requests are the `n` choices of one client request (called by the
        routes before they are sent), so `vllm:request_params_n` counts it once."""
        ...

    def reserve(self, request_ids: list[str]) -> None:
        """Admit the requests of one client request that fans out (prompts x `n`) together,
        before any is sent: they count against `--max-num-queued-reqs` from now on, and each
        goes to the same engine when `generate` is given its id. Raises RequestRejectedError
        when they do not all fit, EngineDeadError when the engine is gone."""
        ...

    def release(self, request_ids: list[str]) -> None:
        """Give back the reserved requests among these that were never sent (call once the
        client request ends, however it ends)."""
        ...

    # The server's own hooks: called once while it starts, and at its end.
    def plugin_reports(self) -> list[dict[str, object]]:
        """The load-report records of every engine core and worker (/v1/plugins, and the
        plugin metrics at each scrape)."""
        ...

    def add_outputs_listener(self, callback: OutputsListener) -> None:
        """Call `callback` with every batch of engine outputs, each naming its
        `engine_index` (the stat loggers, tracing)."""
        ...

    def add_death_listener(self, callback: Callable[[], None]) -> None:
        """Call `callback` once, after every in-flight request failed, if an engine core
        dies (not when the engine is shut down)."""
        ...

    def add_request_hook(self, hook: RequestHook) -> None:
        """Call `hook` as each request is sent, in the caller's context (tracing reads the
        current span there)."""
        ...

    def add_rejection_listener(self, callback: RejectionListener) -> None:
        """Call `callback` with the reason of each request refused for load."""
        ...

    def fail_requests(self, error: BaseException) -> int:
        """End every in-flight request with `error` now and abort them in the engine (the
        drain at shutdown); returns how many there were."""
        ...

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine (called once, when the server stops): in-flight requests fail,
        and `is_dead` turns True."""
        ...


# --------------------------------------------------------------------------- endpoints
@runtime_checkable
class EndpointPlugin(Protocol):
    """An object returned by a `vllm.endpoint_plugins` factory (front-end process only).

    The factory is called while the app is built, after every core route is attached.
    """

    #: A short name, shown in logs and in the load report.
    name: str
    #: Tasks the served model must support for the plugin to attach (any one of them is
    #: enough), e.g. ("generate",) or ("embed",); None attaches on every model.
    required_tasks: tuple[str, ...] | None

    def attach_router(self, app: FastAPI) -> None:
        """Add the plugin's routes to `app`. Called once, in the front end, after the core
        routes. A route with the same path and method as a core route replaces it."""
        ...

    async def init_state(self, engine_client: EngineClient, state: Any, args: Any) -> None:
        """Called once in the front end after the core state is ready and before the
        server accepts requests. `engine_client` is an `EngineClient` (generate, encode,
        abort, tokenizer, model config, tasks); `state` is the app's `app.state`; `args`
        the parsed server arguments."""
        ...


# --------------------------------------------------------------------------- stat loggers
class StatLoggerBase(ABC):
    """Base class of every stat logger (`vllm.stat_logger_plugins`): front-end process.

    Instances are made when the engine client is created, one per engine, and run beside
    the built-in logging and Prometheus loggers. Every call comes on the server's event
    loop: keep them short. One that raises is logged and the logger keeps being called.
    """

    def __init__(self, config: Any, engine_index: int = 0) -> None:
        """`config` is the EngineConfig, with `model.served_model_name` and
        `model.max_model_len` filled in."""
        self.config = config
        self.engine_index = engine_index

    @abstractmethod
    def record(self, scheduler_stats: Any, iteration_stats: Any, engine_idx: int = 0) -> None:
        """Called for every batch of engine outputs that carries stats (each engine step).

        `scheduler_stats`: a `gateway.messages.SchedulerStats` (running and waiting
        requests, KV-cache usage) or None; `iteration_stats`: a
        `gateway.messages.IterationStats` (prompt and generated tokens, first-token and
        inter-token times, finished requests with their reason) or None when nothing
        happened in the step."""

    @abstractmethod
    def log_engine_initialized(self) -> None:
        """Called once, after the engine core's handshake."""

    def log(self) -> None:  # noqa: B027 - optional hook with an empty default
        """Called periodically (every few seconds) to flush or print what was recorded."""


# --------------------------------------------------------------------------- IO processors
IOProcessorInput = TypeVar("IOProcessorInput")
IOProcessorOutput = TypeVar("IOProcessorOutput")


class IOProcessor(ABC, Generic[IOProcessorInput, IOProcessorOutput]):
    """Turns a `/pooling` payload into engine prompts and engine outputs into a response.

    Front-end process; made at start-up, before the engine starts, when
    `--io-processor-plugin` or the model config names the plugin (rule 8). `/pooling` then
    calls, per request: `parse_data`, `pre_process(_async)`, the engine (one pooling request
    per prompt, with `merge_pooling_params(PoolingParams())`), `post_process(_async)`.
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        """`config` is the EngineConfig (the model, its dtype, the engine's limits)."""
        self.config = config

    @abstractmethod
    def parse_data(self, data: object) -> IOProcessorInput:
        """Validate the request's `data`; raise ValueError for a 400 with your message."""

    @abstractmethod
    def pre_process(self, prompt: IOProcessorInput, request_id: str | None = None,
                    **kwargs: Any) -> Any:
        """Turn the parsed input into one prompt or a sequence of prompts for the engine:
        each a text, `{"prompt": text}` or `{"prompt_token_ids": [...]}`. A ValueError
        here is a 400 too."""

    async def pre_process_async(self, prompt: IOProcessorInput, request_id: str | None = None,
                                **kwargs: Any) -> Any:
        return self.pre_process(prompt, request_id, **kwargs)

    @abstractmethod
    def post_process(self, model_output: Sequence[Any], request_id: str | None = None,
                     **kwargs: Any) -> IOProcessorOutput:
        """Turn the engine's pooling outputs (in prompt order) into the response's `data`
        (JSON data or a pydantic model). Each output has `request_id`, `prompt_token_ids`
        and `outputs.data`, the pooled vector (a float32 numpy array; vLLM's is a
        tensor)."""

    async def post_process_async(self, model_output: Sequence[Any],
                                 request_id: str | None = None,
                                 **kwargs: Any) -> IOProcessorOutput:
        return self.post_process(model_output, request_id, **kwargs)

    def merge_pooling_params(self, params: Any = None) -> Any:
        """Return the `gateway.pooling_params.PoolingParams` to pool with (default: the
        given ones, unchanged)."""
        return params


# --------------------------------------------------------------------------- logits processors
class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()  # the row at `from` moves to `to`; `from` becomes empty
    SWAP = enum.auto()  # the rows at `from` and `to` trade places


# (batch row index, the request's params, prompt token ids, output token ids). The output
# list is the worker's own: it grows in place as the request generates.
AddedRequest = tuple[int, "SamplingParams", list[int], list[int]]
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass
class BatchUpdate:
    """How the persistent batch changed since the last step (vLLM's shape).

    Apply in this order: `removed`, then `added`, then `moved`.
    """

    batch_size: int
    added: Sequence[AddedRequest] = field(default_factory=list)
    removed: Sequence[int] = field(default_factory=list)
    moved: Sequence[MovedRequest] = field(default_factory=list)


class LogitsProcessor(ABC):
    """A batch-level logits processor (`vllm.logits_processors`): worker processes.

    One instance per worker, made when the sampler is built. Not filtered by VLLM_PLUGINS;
    a class that fails to load stops start-up.
    """

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.config = config
        self.device = device
        self.is_pin_memory = is_pin_memory

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Called for each new request, in the engine core before it is scheduled; raise
        ValueError to refuse it (the client gets HTTP 400 naming the parameter)."""
        return None  # the default accepts every request

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if `apply` never changes which token has the highest logit (then greedy
        requests may skip it)."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every step with the batch changes since the last (None: none)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Called each step with logits [batch_size, vocab_size]; return the new logits
        (in place is allowed). Rows follow the persistent batch's row indices."""


# --------------------------------------------------------------------------- LoRA resolvers
class LoRAResolver(ABC):
    """Finds a LoRA adapter by the name a request puts in `model` (vLLM's shape). A
    general plugin makes one and registers it by name with `LoRAResolverRegistry`
    (gateway.plugins.lora_resolvers), in every process it runs in; the front end asks the
    registered resolvers, in registration order, about a name it does not know."""

    @abstractmethod
    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        """Called in the API-server process, on its event loop, for a request naming an
        unknown model (with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING): the
        adapter's `LoRARequest` (its lora_int_id is replaced by the server's), or None
        when this resolver does not have it. One that raises, or takes longer than
        GATEWAY_LORA_RESOLVER_TIMEOUT_S, is recorded as a failure and the next is asked."""
