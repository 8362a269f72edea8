"""The message types that cross a process boundary: the only vocabulary the front end, the
engine core and the workers share. All are msgspec Structs, encoded as msgpack."""

from __future__ import annotations

import msgspec

from gateway.pooling_params import PoolingParams
from gateway.sampling_params import SamplingParams

__all__ = ["SamplingParams", "PoolingParams", "TokenLogprobs", "NewRequestData",
           "CachedRequestData", "SchedulerOutput", "ModelRunnerOutput"]


# --------------------------------------------------------------- logprobs
class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log-probabilities at one position, from the model's raw distribution: the chosen
    token (sampled, or the prompt's next token) first, then the top N in rank order (the
    chosen one may appear again among them)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # the chosen token's rank (1: the most likely)


# --------------------------------------------------------------- engine core -> worker
class NewRequestData(msgspec.Struct, kw_only=True):
    """A request the worker has not seen (or sees again after preemption by recompute)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]  # KV-cache blocks held so far, in order
    # Tokens generated before a preemption; the worker recomputes prompt + these.
    output_token_ids: list[int] = msgspec.field(default_factory=list)
    num_computed_tokens: int = 0
    # Set for a pooling request (embed): the whole prompt is scheduled in one step, and
    # the runner answers with its pooled vector instead of a sampled token.
    pooling_params: PoolingParams | None = None


class CachedRequestData(msgspec.Struct, kw_only=True):
    """A request the worker already holds, continuing this step."""

    req_id: str
    new_block_ids: list[int]  # blocks appended since the last step
    num_computed_tokens: int  # tokens whose KV is already cached
    #: The blocks it holds, new ones included (None: those held before plus the new):
    #: fewer when blocks that held only rejected draft tokens were released.
    num_blocks: int | None = None


class SchedulerOutput(msgspec.Struct, kw_only=True):
    """What to run in one step. Requests absent from `num_scheduled_tokens` wait."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step
    finished_req_ids: list[str]  # finished, aborted or preempted since the last step
    # Structured outputs: the requests sampled this step under a grammar, and their
    # allowed-token bitmask, int32 [len(grammar_req_ids), ceil(vocab / 32)] as bytes
    # (native order; bit j of word i allows token 32 * i + j), one row per id in order.
    grammar_req_ids: list[str] = msgspec.field(default_factory=list)
    grammar_bitmask: bytes | None = None
    #: Speculative decoding: req_id -> the draft tokens scheduled after its last known
    #: token (counted in num_scheduled_tokens); the worker verifies them this step.
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)
    #: Speculative decoding with a draft model: the requests the worker proposes drafts
    #: for after this step (they sample a token and hold KV slots for the proposals).
    draft_req_ids: list[str] = msgspec.field(default_factory=list)


class ModelRunnerOutput(msgspec.Struct, kw_only=True):
    """Sampled tokens of one step, for requests that finished their prompt this step or
    earlier; a request still part-way through a chunked prefill has no entry."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    # Requests whose logits processor failed this step: req_id -> error text.
    errors: dict[str, str] = msgspec.field(default_factory=dict)
    # Pooling requests done this step: req_id -> the pooled vector as float32 bytes
    # (native order, numpy's `tobytes()`); these requests are not in `req_ids`.
    pooler_outputs: dict[str, bytes] = msgspec.field(default_factory=dict)
    # Requests that asked for logprobs: req_id -> those of the token sampled this step.
    logprobs: dict[str, TokenLogprobs] = msgspec.field(default_factory=dict)
    # Requests that asked for prompt logprobs and sampled their first token this step:
    # req_id -> one entry per prompt token after the first.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = msgspec.field(default_factory=dict)
    #: Requests that verified drafts: req_id -> the tokens after its one in
    #: sampled_token_ids (the accepted drafts past the first, then the target's token).
    more_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)
    #: Speculative decoding with a draft model: req_id -> the draft model's proposals for
    #: the request's next step (for each of SchedulerOutput.draft_req_ids that sampled).
    draft_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)


# --------------------------------------------------------------- front end <-> engine core
class EngineCoreRequest(msgspec.Struct, tag="add", array_like=True):
    """A new request (front end -> engine core): generation, or pooling when
    `pooling_params` is set (its `sampling_params` are then ignored)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    pooling_params: PoolingParams | None = None
    # One sequence of a client request that fans out (prompts x n) whose other sequences
    # already produced tokens: the request has started, so the queue deadline does not
    # refuse this one (nothing admitted is dropped).
    sibling_started: bool = False


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """Stop these requests and free their KV cache (front end -> engine core)."""

    request_ids: list[str]
    # Why, for the stats: "abort" (the client went away) or "stop" (the front end found a
    # stop string, so the request ended as a normal stop).
    reason: str = "abort"


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Finish: the engine core exits its loop and stops its workers."""


EngineCoreInput = EngineCoreRequest | AbortRequests | Shutdown


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request this step, and how it finished (if it did)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id, when one ended it
    error: str | None = None
    error_kind: str | None = None  # "invalid_request" (HTTP 400) | "internal" (500)
    error_param: str | None = None
    # A finished pooling request's vector: float32 bytes (see ModelRunnerOutput).
    pooling_output: bytes | None = None
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # with the first token, when asked


class PrefixCacheStats(msgspec.Struct, array_like=True):
    """Prefix-cache lookups since the last stats, in tokens (vLLM's fields): each newly
    scheduled request looks up its `queries` tokens and finds `hits` of them cached."""

    requests: int = 0
    queries: int = 0
    hits: int = 0


class SchedulerStats(msgspec.Struct, array_like=True):
    """The scheduler's state after a step."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float  # fraction of KV-cache blocks in use, 0..1
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int = 0  # since the last stats
    prefix_cache_stats: PrefixCacheStats | None = None  # None: prefix caching is off
    # LoRA adapters (--enable-lora): name -> requests running, and waiting, with it.
    running_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)


class FinishedRequestStats(msgspec.Struct, array_like=True):
    """One request that finished this step (vLLM's fields). Times in seconds; the
    arrival time is the front end's, when it sent the request."""

    request_id: str
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float  # arrival -> finished
    queued_time: float  # arrival -> first scheduled
    prefill_time: float  # first scheduled -> first token (0.0 without a first token)
    decode_time: float  # first token -> finished (0.0 without a first token)
    inference_time: float  # first scheduled -> finished
    max_tokens_param: int | None = None


class SpecDecodingStats(msgspec.Struct, array_like=True):
    """Draft verification since the last stats (vLLM's fields): drafts (requests' steps
    that verified some), their tokens, the accepted ones, and accepted ones by position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for position in range(num_accepted_tokens):
            per_pos[position] += 1


class GrammarCompileStats(msgspec.Struct, array_like=True):
    """One grammar compilation the engine core finished or stopped."""

    seconds: float  # the trial's and the engine core's compile together
    outcome: str  # "compiled" | "invalid" | "timeout" | "memory"


class IterationStats(msgspec.Struct, array_like=True):
    """What one engine step did, measured in the engine core (vLLM's field names)."""

    num_prompt_tokens: int  # prompts of the requests that got their first token this step
    num_generation_tokens: int  # tokens sampled this step
    time_to_first_tokens_iter: list[float]  # arrival -> first token, one per such request
    inter_token_latencies_iter: list[float]  # since the request's previous token
    finished_requests: list[FinishedRequestStats]
    # The `n` of each client request whose last choice finished this step: filled in by the
    # front end (engine/parallel_sampling.py), which alone knows the choices of a request.
    n_params_iter: list[int] = msgspec.field(default_factory=list)
    #: Grammar compilations that ended since the last stats (structured outputs).
    grammar_compiles: list[GrammarCompileStats] = msgspec.field(default_factory=list)
    #: Speculative decoding's drafts verified this step (None: none were).
    spec_decoding_stats: SpecDecodingStats | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True):
    """One batch of outputs (engine core -> front end), sent after each step, with the
    step's stats (None when the engine does not collect them), so stat loggers need no
    second channel."""

    outputs: list[EngineCoreOutput]
    timestamp: float
    scheduler_stats: SchedulerStats | None = None
    iteration_stats: IterationStats | None = None
    engine_index: int = 0  # the data-parallel rank of the engine that sent it (vLLM's)


class EngineHeartbeat(msgspec.Struct, array_like=True):
    """Engine core -> front end, twice a second from a thread of the core's own, on a
    socket of its own: the steps the core has completed so far and the requests it holds.
    It keeps coming while the core's main loop is stuck (a stopped worker, a hung
    collective), and stops only when the whole process is frozen or gone; the front end's
    liveness check reads both."""

    num_steps: int
    num_unfinished_requests: int
    timestamp: float


class EngineHandshake(msgspec.Struct, tag="handshake"):
    """The engine core's first message: ready (error None) or why it could not start."""

    supported_tasks: list[str]
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    eos_token_ids: list[int]
    vocab_size: int
    plugin_reports: list[dict[str, object]]
    pid: int
    error: str | None = None
    # The server's processes on this host, by role ("engine-core", "worker-0", ...): pid,
    # for the front end's process metrics.
    processes: dict[str, int] = msgspec.field(default_factory=dict)


# --------------------------------------------------------------- worker ranks -> engine core
class WorkerStatus(msgspec.Struct, kw_only=True):
    """One tensor-parallel rank at start-up: where it runs, its plugin load report, the
    KV-cache blocks its budget holds, or why it failed. Every rank sends its status to the
    others; rank 0 sends them all to the engine core in WorkersReady."""

    rank: int
    pid: int
    host: str
    plugin_reports: list[dict[str, object]] = msgspec.field(default_factory=list)
    num_kv_blocks: int = 0
    error: str | None = None
    #: The error is a config.ConfigurationError: a flag to change, logged without traceback.
    is_configuration_error: bool = False


class WorkersReady(msgspec.Struct, kw_only=True):
    """Rank 0 -> engine core, once: every rank's status and what the model serves, or
    (`error` set) why the ranks could not start; they have all exited then."""

    statuses: list[WorkerStatus]
    num_kv_blocks: int = 0  # the fewest any rank's budget holds: what every rank allocates
    supported_tasks: list[str] = msgspec.field(default_factory=list)
    max_model_len: int = 0
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    vocab_size: int = 0
    device_type: str = "cpu"  # the ranks' torch device type ("cpu", "cuda")
    error: str | None = None
    is_configuration_error: bool = False  # every failed rank's error is one
