"""The engine client: the API server's handle on the engine, over one engine core or several
(API-server process; torch is never imported here).

`AsyncEngineClient` implements the plugin contract `gateway.plugins.EngineClient` once,
whatever the engine's shape: one engine core, N data-parallel ones (spawned or Ray
actors), or those the supervisor started for one of several API servers. Each engine core
is an `EngineConnection` (connection.py: its sockets, output loop and liveness); the
client owns the requests over them. A request that fans out reserves its sequences at once
(`reserve`): admitted together on one engine, counted until each is sent or released.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import msgspec

from gateway.config import EngineConfig, ModelConfig
from gateway.frontend.engine_client.admission import Admission, queue_limit
from gateway.frontend.engine_client.balance import LoadBalancer
from gateway.frontend.engine_client.connection import (
    DEFAULT_STARTUP_TIMEOUT_S,
    EngineConnection,
)
from gateway.frontend.engine_client.errors import EngineDeadError, EngineStartError
from gateway.frontend.engine_client.launch import start_local_engines
from gateway.frontend.engine_client.liveness import DEFAULT_STALL_THRESHOLD_S
from gateway.frontend.engine_client.ray_engines import start_ray_engines
from gateway.frontend.http.request_logger import RequestLogger
from gateway.frontend.outputs.output_processor import OutputProcessor, RequestState
from gateway.logger import init_logger
from gateway.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)
from gateway.models.info.paths import (
    ModelInfo,
    fetch_draft_model,
    fetch_model_config,
    read_model_info,
    resolve_model_path,
)
from gateway.models.info.support import UnsupportedModelError, check_supported
from gateway.outputs import PoolingRequestOutput, RequestOutput
from gateway.plugins.contracts import (
    OutputsListener,
    RejectionListener,
    RequestHook,
)
from gateway.pooling_params import PoolingParams
from gateway.ray_cluster import RayCluster
from gateway.sampling_params import InvalidParameterError, SamplingParams
from gateway.tokenizer import Tokenizer, load_tokenizer

logger = init_logger(__name__)


@dataclass(frozen=True)
class ClientOptions:
    """What the server's flags set on the engine client."""

    #: --max-num-queued-reqs: requests in flight each engine admits (None: no limit).
    max_num_queued_reqs: int | None = None
    #: --engine-stall-threshold: no step this long with requests pending is a stall.
    stall_threshold_s: float = DEFAULT_STALL_THRESHOLD_S
    #: --enable-log-requests: logs every request it is given.
    request_logger: RequestLogger | None = None


@dataclass
class _Reservation:
    """The sequences of one client request, admitted together on engine `engine`."""

    engine: int
    #: Whether one of them produced output: the client request has started.
    has_started: bool = False


class AsyncEngineClient:
    """The engine client over `connections`. Made by `start` (the engine cores are started
    here) or `from_connections` (they were started elsewhere).

    1. A new request goes to the engine the load balancer picks (balance.py; with one engine,
       that one), if that engine's admission lets it in (admission.py), and stays there.
    2. Each batch of outputs an engine sends goes to the output processor
       (outputs/output_processor.py), which puts each request's next `RequestOutput` on its
       stream; then the batch goes to the listeners (the stat loggers, tracing).
    3. A request whose caller stops iterating is aborted in its engine.
    4. An engine core that dies ends the client: every request in flight on every engine fails
       at once with EngineDeadError, `is_dead` turns True (/health answers 503), and the death
       listeners run, once.
    """

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, model_info: ModelInfo,
                 connections: list[EngineConnection], *,
                 options: ClientOptions = ClientOptions(),
                 cluster: RayCluster | None = None) -> None:
        first = connections[0].handshake
        self.config = config
        self.tokenizer = tokenizer
        self.model_info: ModelInfo | None = model_info
        self.model_name = config.model.served_model_name or _default_name(config)
        self.supported_tasks: tuple[str, ...] = tuple(first.supported_tasks)
        self.max_model_len = min(c.handshake.max_model_len for c in connections)
        self.num_kv_blocks = first.num_kv_blocks  # per engine: each has its own cache
        self.block_size = first.block_size
        self.vocab_size = first.vocab_size
        self.is_dead = False
        self.dead_reason: str | None = None
        self.connections = connections
        #: The load balancer's choices and loads (data parallel).
        self.balancer = LoadBalancer(len(connections))
        self._is_data_parallel = (len(connections) > 1
                                  or config.parallel.data_parallel_backend == "ray")
        self._cluster = cluster  # the Ray cluster the engines run on, left at shutdown
        self._request_logger = options.request_logger
        self._stall_threshold_s = options.stall_threshold_s
        self._outputs = OutputProcessor(tokenizer, len(connections), config.log_stats)
        self._encoder = msgspec.msgpack.Encoder()
        self._rejection_listeners: list[RejectionListener] = []
        #: --max-num-queued-reqs for each engine (each caps its own requests, as each vLLM
        #: engine does), with one list of rejection listeners.
        self._admissions = [self._admission(c.index, options.max_num_queued_reqs)
                            for c in connections]
        #: Reserved sequences not sent yet: request id -> its reservation; count by engine.
        self._reserved: dict[str, _Reservation] = {}
        self._num_reserved = [0] * len(connections)
        self._listeners: list[OutputsListener] = []
        self._death_listeners: list[Callable[[], None]] = []
        self._request_hooks: list[RequestHook] = []

    def _admission(self, engine: int, limit: int | None) -> Admission:
        admission = Admission(
            lambda: self._outputs.num_requests(engine) + self._num_reserved[engine], limit)
        admission.rejection_listeners = self._rejection_listeners
        return admission

    # ------------------------------------------------------------------ start and stop
    @classmethod
    async def start(cls, config: EngineConfig,
                    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                    model_info: ModelInfo | None = None,
                    options: ClientOptions = ClientOptions()) -> AsyncEngineClient:
        """Start the engine core(s) `config` asks for (one; one per data-parallel rank;
        Ray actors with `--data-parallel-backend ray`) and return once each has answered
        its handshake.

        Raises EngineStartError with the core's own message when one cannot start."""
        # A Hugging Face repo id becomes its local path here (the engine core and workers
        # get the path); `gateway serve` has done this already, before binding its port.
        config.model = await asyncio.to_thread(fetch_model_config, config.model)
        config.speculative = await asyncio.to_thread(fetch_draft_model, config.speculative,
                                                     config.model)
        path = resolve_model_path(config.model.model)
        if model_info is None:  # the caller may have read it already
            model_info = await asyncio.to_thread(read_model_info, str(path))
        try:  # before the engine core starts: no weight is read for a model it cannot serve
            check_supported(model_info)
        except UnsupportedModelError as exc:
            raise EngineStartError(str(exc)) from exc
        tokenizer = await asyncio.to_thread(load_tokenizer, path)
        cluster = None
        if config.parallel.data_parallel_backend == "ray":
            cluster, connections = await start_ray_engines(config, startup_timeout_s)
        else:
            connections = await start_local_engines(config, startup_timeout_s)
        for connection in connections:
            handshake = connection.handshake
            logger.info("Engine core ready (pid %d): tasks %s, %d KV blocks of %d tokens, "
                        "max model length %d.", handshake.pid, handshake.supported_tasks,
                        handshake.num_kv_blocks, handshake.block_size,
                        handshake.max_model_len)
        return cls.from_connections(config, tokenizer, model_info, connections,
                                    options=options, cluster=cluster)

    @classmethod
    def from_connections(cls, config: EngineConfig, tokenizer: Tokenizer,
                         model_info: ModelInfo, connections: list[EngineConnection], *,
                         options: ClientOptions = ClientOptions(),
                         cluster: RayCluster | None = None) -> AsyncEngineClient:
        """The client over engine cores already connected (several API servers), watching
        them from now on (call in the running event loop)."""
        client = cls(config, tokenizer, model_info, connections, options=options,
                     cluster=cluster)
        for connection in connections:
            connection.liveness.expire_waiting = functools.partial(client._expire_waiting,
                                                                   connection.index)
            connection.watch(client._on_outputs, client._on_engine_death,
                             functools.partial(client._outputs.num_requests, connection.index),
                             client._stall_threshold_s)
        return client

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every engine core this process started (at once; another process's keep
        running for the other API servers) and close the sockets; fail what is still in
        flight; leave the Ray cluster the engines ran on, if any."""
        if not self.is_dead:
            self.is_dead, self.dead_reason = True, "shut down"
        await asyncio.gather(*(c.shutdown(timeout_s) for c in self.connections))
        what = "engine" if self.connections[0].owns_engine else "server"
        self._outputs.fail_all(EngineDeadError(f"the {what} was shut down"))
        if self._cluster is not None:
            await asyncio.to_thread(self._cluster.leave)

    # ------------------------------------------------------------------ facts
    @property
    def model_config(self) -> ModelConfig:
        return self.config.model

    @property
    def engine_pid(self) -> int:
        """The (first) engine core's pid."""
        return self.connections[0].pid

    @property
    def latest_stats(self) -> SchedulerStats | None:
        """The engine core's last scheduler stats (None with several engines: each has its
        own, `connections[i].latest_stats`)."""
        return self.connections[0].latest_stats if len(self.connections) == 1 else None

    @property
    def process_pids(self) -> dict[str, int]:
        return {role: pid for c in self.connections for role, pid in c.process_pids.items()}

    @property
    def gc_stats_dirs(self) -> list[str]:
        return [c.gc_stats_dir for c in self.connections if c.gc_stats_dir is not None]

    @property
    def stalled_reason(self) -> str | None:
        for connection in self.connections:
            reason = connection.liveness.stalled_reason
            if reason is not None:
                return self._engine_named(connection, reason)
        return None

    @property
    def num_inflight_requests(self) -> int:
        return len(self._outputs)

    def plugin_reports(self) -> list[dict[str, object]]:
        return [record for c in self.connections for record in c.handshake.plugin_reports]

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncGenerator[RequestOutput, None]:
        connection, reservation = self._assign(request_id)
        state = RequestState.make(request_id, prompt_token_ids, params, self.tokenizer)
        # Encoded before the request is registered: a request that cannot be sent leaves
        # nothing behind in the in-flight table.
        message = self._encode(EngineCoreRequest(
            request_id, prompt_token_ids, params, time.time(),
            sibling_started=reservation is not None and reservation.has_started))
        self._outputs.add_generation(state, connection.index)
        self._log_inputs(request_id, prompt_token_ids, params)
        connection.send_bytes(message)
        try:
            while True:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if reservation is not None:
                    reservation.has_started = True
                if item.finished and self._request_logger is not None:
                    self._request_logger.log_output(request_id, item.text, item.token_ids,
                                                    item.finish_reason,
                                                    len(prompt_token_ids))
                yield item
                if item.finished:
                    return
        finally:
            self._outputs.end_generation(request_id)
            if not state.finished and connection.dead_reason is None:
                connection.send(AbortRequests([request_id]))

    async def encode(self, prompt_token_ids: list[int], params: PoolingParams,
                     request_id: str) -> PoolingRequestOutput:
        connection, reservation = self._assign(request_id)
        message = self._encode(EngineCoreRequest(
            request_id, prompt_token_ids, _POOLING_SAMPLING, time.time(), params,
            sibling_started=reservation is not None and reservation.has_started))
        future = self._outputs.add_pooling(request_id, prompt_token_ids, connection.index)
        self._log_inputs(request_id, prompt_token_ids, params)
        connection.send_bytes(message)
        try:
            output = await future
            if reservation is not None:
                reservation.has_started = True
            return output
        finally:
            if self._outputs.end_pooling(request_id) is not None \
                    and connection.dead_reason is None:
                connection.send(AbortRequests([request_id]))

    async def abort(self, request_id: str) -> None:
        engine = self._outputs.engine_of(request_id)
        state = self._outputs.end_generation(request_id)
        if state is None or engine is None:
            return
        connection = self.connections[engine]
        if connection.dead_reason is None and not self.is_dead:
            connection.send(AbortRequests([request_id]))
            if not state.finished:
                state.finished = True
                state.queue.put_nowait(RequestOutput(
                    request_id, state.prompt_token_ids, state.detokenizer.output_text, "",
                    list(state.token_ids), [], True, "abort"))

    def add_parent_request(self, child_request_ids: list[str]) -> None:
        self._outputs.parent_requests.add(child_request_ids)

    def reserve(self, request_ids: list[str]) -> None:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        index = self.balancer.choose(len(request_ids))
        self._admissions[index].check(len(request_ids))
        reservation = _Reservation(index)
        for request_id in request_ids:
            self._reserved[request_id] = reservation
        self._num_reserved[index] += len(request_ids)

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            reservation = self._reserved.pop(request_id, None)
            if reservation is not None:
                self._num_reserved[reservation.engine] -= 1

    def fail_requests(self, error: BaseException) -> int:
        request_ids = list(self._outputs.generations) + list(self._outputs.poolings)
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            engine = self._outputs.engine_of(request_id)
            if engine is not None:
                by_engine.setdefault(engine, []).append(request_id)
        self._outputs.fail_all(error)
        for index, ids in by_engine.items():
            if self.connections[index].dead_reason is None:
                self.connections[index].send(AbortRequests(ids))
        return len(request_ids)

    # ------------------------------------------------------------------ listeners
    def add_outputs_listener(self, callback: OutputsListener) -> None:
        self._listeners.append(callback)

    def add_death_listener(self, callback: Callable[[], None]) -> None:
        self._death_listeners.append(callback)

    def add_request_hook(self, hook: RequestHook) -> None:
        self._request_hooks.append(hook)

    def add_rejection_listener(self, callback: RejectionListener) -> None:
        self._rejection_listeners.append(callback)

    # ------------------------------------------------------------------ internals
    def _assign(self, request_id: str) -> tuple[EngineConnection, _Reservation | None]:
        """The engine for a new request: its reservation's, or the balancer's choice if its
        admission lets the request in (RequestRejectedError when its queue is full)."""
        reservation = self._reserved.pop(request_id, None)
        if reservation is not None:
            self._num_reserved[reservation.engine] -= 1
        if self.is_dead:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if request_id in self._outputs:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if reservation is not None:
            return self.connections[reservation.engine], reservation
        index = self.balancer.choose()
        self._admissions[index].check()
        return self.connections[index], None

    def _engine_named(self, connection: EngineConnection, text: str) -> str:
        return f"data-parallel engine {connection.index}: {text}" \
            if self._is_data_parallel else text

    def _log_inputs(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | PoolingParams) -> None:
        for hook in self._request_hooks:
            try:
                hook(request_id, len(prompt_token_ids), params)
            except Exception:
                logger.exception("A request hook raised (request %s).", request_id)
        if self._request_logger is None:
            return
        limit = self._request_logger.max_log_len
        ids = prompt_token_ids if limit is None else prompt_token_ids[:limit]
        prompt = self.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
        self._request_logger.log_inputs(request_id, prompt, prompt_token_ids, params)

    def _encode(self, request: EngineCoreRequest) -> bytes:
        """The request's bytes; InvalidParameterError naming the field when a value cannot
        be sent (text that is not valid Unicode, nesting too deep for the encoder)."""
        try:
            return self._encoder.encode(request)
        except (UnicodeError, RecursionError, ValueError, TypeError) as exc:
            raise InvalidParameterError(_unsendable_field(self._encoder, request),
                                        "a value of this field cannot be sent to the engine "
                                        f"({type(exc).__name__})") from None

    def _on_outputs(self, index: int, outputs: EngineCoreOutputs) -> None:
        """A connection's batch of outputs: to each request's stream, then the listeners."""
        processed = self._outputs.process(outputs)
        for request_id, reason in processed.refused:
            self._outputs.refuse(request_id, self._refusal(index, reason))
        for request_id in processed.stopped:
            self.connections[index].send(AbortRequests([request_id], "stop"))
        if processed.num_finished:
            self._admissions[index].note_finished(processed.num_finished)
        if outputs.scheduler_stats is not None:
            self.balancer.report(index, outputs.scheduler_stats)
        for listener in self._listeners:
            try:
                listener(outputs)
            except Exception:
                logger.exception("An engine-outputs listener raised.")

    def _expire_waiting(self, index: int, progress_at: float) -> int:
        """Engine `index` has completed no step since `progress_at`, so it cannot apply the
        queue deadline: refuse (503, aborted there) the requests sent to it since then that
        are past theirs, counted from their arrival; return how many others arrived since."""
        now, server_limit = time.monotonic(), self.config.scheduler.max_queue_time
        expired: dict[str, str] = {}
        num_arrived = 0
        for request_id, arrived_at, own_limit in self._outputs.arrived_since(index,
                                                                           progress_at):
            limit, waited = queue_limit(own_limit, server_limit), now - arrived_at
            if limit is None or waited <= limit[0]:
                num_arrived += 1
            else:
                expired[request_id] = (
                    f"the request waited {waited:.1f} s in the queue, over the limit of "
                    f"{limit[0]:g} s ({limit[1]}), while no engine step completed")
        if expired and self.connections[index].dead_reason is None:
            for request_id, reason in expired.items():
                self._outputs.refuse(request_id, self._refusal(index, reason))
            self.connections[index].send(AbortRequests(list(expired)))
        return num_arrived

    def _refusal(self, index: int, reason: str) -> BaseException:
        """The 503's error of a request engine `index` refused by its queue deadline."""
        stats = self.connections[index].latest_stats
        waiting = stats.num_waiting_reqs if stats else 1
        return self._admissions[index].reject(
            "queue_timeout", f"The request was not started in time: {reason}; retry later.",
            waiting)

    def _on_engine_death(self, index: int) -> None:
        if self.is_dead:
            return
        connection = self.connections[index]
        self.is_dead = True
        self.dead_reason = self._engine_named(connection, connection.dead_reason or "")
        logger.error("Engine died: %s; failing %d in-flight requests.", self.dead_reason,
                     self.num_inflight_requests)
        self._outputs.fail_all(EngineDeadError(self.dead_reason))
        for callback in self._death_listeners:
            try:
                callback()
            except Exception:
                logger.exception("An engine-death listener raised.")


def _unsendable_field(encoder: msgspec.msgpack.Encoder, request: EngineCoreRequest) -> str:
    params = request.sampling_params
    for name, value in (("vllm_xargs", params.extra_args), ("stop", params.stop)):
        try:
            encoder.encode(value)
        except (UnicodeError, RecursionError, ValueError, TypeError):
            return name
    return "prompt"


# A pooling request's sampling params are never read; one shared default is sent.
_POOLING_SAMPLING = SamplingParams(max_tokens=1)


def _default_name(config: EngineConfig) -> str:
    return config.model.model or "SmolLM2-135M-Instruct"
