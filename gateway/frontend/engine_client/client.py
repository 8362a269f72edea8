"""The engine client: the front end's handle on the engine-core process.

`EngineClient.start(config)` spawns the engine core (multiprocessing spawn, never fork),
waits for its handshake, and from then on sends requests and aborts over one ZMQ socket
and receives batched outputs on another, routing each output to its request's stream.
The core process is watched through its sentinel: when it dies, every pending request
fails with EngineDeadError and `is_dead` turns True. Torch is never imported here.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from gateway import gc_stats
from gateway.config import EngineConfig, ModelConfig
from gateway.frontend.engine_client.admission import Admission, RequestRejectedError
from gateway.frontend.engine_client.liveness import EngineLiveness
from gateway.frontend.http.request_logger import RequestLogger
from gateway.frontend.outputs.output_processor import (
    PoolingRequestOutput,
    RequestOutput,
    RequestState,
)
from gateway.frontend.outputs.parallel_sampling import ParentRequests
from gateway.logger import init_logger
from gateway.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineHandshake,
    EngineHeartbeat,
    SchedulerStats,
    Shutdown,
)
from gateway.models.info.paths import (
    ModelInfo,
    fetch_model_config,
    read_model_info,
    resolve_model_path,
)
from gateway.models.info.support import UnsupportedModelError, check_supported
from gateway.pooling_params import PoolingParams
from gateway.sampling_params import InvalidParameterError, SamplingParams
from gateway.tokenizer import load_tokenizer

logger = init_logger(__name__)

__all__ = ["EngineClient", "EngineDeadError", "PoolingRequestOutput", "RequestOutput",
           "RequestRejectedError"]


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can be served."""


class EngineStartError(RuntimeError):
    """The engine core could not start (its message says why)."""


OutputsCallback = Callable[[EngineCoreOutputs], None]


class EngineClient:
    def __init__(self, config: EngineConfig, tokenizer: Any, handshake: EngineHandshake,
                 process: Any, context: zmq.asyncio.Context, input_socket: zmq.asyncio.Socket,
                 output_socket: zmq.asyncio.Socket, ipc_dir: str,
                 model_info: ModelInfo | None = None,
                 heartbeat_socket: zmq.asyncio.Socket | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        #: The served model's config (torch-free), e.g. its embedding size.
        self.model_info = model_info
        self.model_name = config.model.served_model_name or _default_name(config)
        self.supported_tasks: tuple[str, ...] = tuple(handshake.supported_tasks)
        self.max_model_len = handshake.max_model_len
        self.num_kv_blocks = handshake.num_kv_blocks
        self.block_size = handshake.block_size
        self.vocab_size = handshake.vocab_size
        self.engine_pid = handshake.pid
        #: The server's processes on this host by role (engine core, local workers): pid.
        self.process_pids: dict[str, int] = dict(handshake.processes)
        #: Where those processes keep their garbage-collector counts (gateway/gc_stats.py).
        self.gc_stats_dir: str | None = ipc_dir
        self.latest_stats: SchedulerStats | None = None
        self.is_dead = False
        self.dead_reason: str | None = None
        self._handshake = handshake
        self._process = process
        self._context = context
        self._input = input_socket
        self._output = output_socket
        self._ipc_dir = ipc_dir
        self._requests: dict[str, RequestState] = {}
        self._pooling: dict[str, tuple[list[int], asyncio.Future[PoolingRequestOutput]]] = {}
        self._encoder = msgspec.msgpack.Encoder()
        # Requests a stop string ended here whose end the engine has not yet counted: the
        # engine may reach max_tokens before the abort arrives, and count it as "length".
        self._stopped_here: set[str] = set()
        self._count_stops = config.log_stats
        self._listeners: list[OutputsCallback] = []
        self._death_listeners: list[Callable[[], None]] = []
        self._output_task: asyncio.Task[None] | None = None
        self._heartbeat = heartbeat_socket
        self._liveness_task: asyncio.Task[None] | None = None
        #: Whether the engine makes progress (its heartbeat); /health reads it.
        self.liveness = EngineLiveness(lambda: self.num_inflight_requests)
        #: Load shedding (--max-num-queued-reqs): checked before a request is sent.
        self.admission = Admission(lambda: self.num_inflight_requests)
        #: Set by `gateway serve --enable-log-requests`: logs every request it is given.
        self.request_logger: RequestLogger | None = None
        #: Called with (request_id, number of prompt tokens, params) as each request is
        #: sent, in the caller's context (tracing reads the current span there).
        self.request_hooks: list[Callable[[str, int, Any], None]] = []
        #: The choices of each request with n > 1 (for `vllm:request_params_n`).
        self.parent_requests = ParentRequests()

    # ------------------------------------------------------------------ start and stop
    @classmethod
    async def start(cls, config: EngineConfig, startup_timeout_s: float = 900.0,
                    model_info: ModelInfo | None = None,
                    launcher: EngineLauncher | None = None) -> EngineClient:
        """Spawn the engine-core process (or have `launcher` start the engine core
        elsewhere, e.g. as a Ray actor) and return once it has answered its handshake.

        Raises EngineStartError with the core's own message when it cannot start."""
        launcher = launcher or SpawnedEngine()
        # A Hugging Face repo id becomes its local path here (the engine core and workers
        # get the path); `gateway serve` has done this already, before binding its port.
        config.model = await asyncio.to_thread(fetch_model_config, config.model)
        path = resolve_model_path(config.model.model)
        if model_info is None:  # the caller may have read it already
            model_info = await asyncio.to_thread(read_model_info, str(path))
        try:  # before the engine core starts: no weight is read for a model it cannot serve
            check_supported(model_info)
        except UnsupportedModelError as exc:
            raise EngineStartError(str(exc)) from exc
        tokenizer = await asyncio.to_thread(load_tokenizer, path)
        ipc_dir = tempfile.mkdtemp(prefix="gateway-ipc-")
        context = zmq.asyncio.Context()
        input_socket, output_socket, heartbeat_socket = (
            context.socket(zmq.PUSH), context.socket(zmq.PULL), context.socket(zmq.PULL))
        process = None
        try:
            addresses = [_bind(socket, address) for socket, address in zip(
                (input_socket, output_socket, heartbeat_socket), launcher.addresses(ipc_dir))]
            with gc_stats.shared_with_children(ipc_dir):  # python_gc_* of engine and workers
                process = launcher.start(msgspec.msgpack.encode(config), *addresses)
            handshake = await _await_handshake(output_socket, process, startup_timeout_s)
        except BaseException:
            if process is not None:
                _stop_process(process)
            context.destroy(linger=0)
            shutil.rmtree(ipc_dir, ignore_errors=True)
            raise
        client = cls(config, tokenizer, handshake, process, context, input_socket,
                     output_socket, ipc_dir, model_info, heartbeat_socket)
        client._watch()
        logger.info("Engine core ready (pid %d): tasks %s, %d KV blocks of %d tokens, "
                    "max model length %d.", handshake.pid, handshake.supported_tasks,
                    handshake.num_kv_blocks, handshake.block_size, handshake.max_model_len)
        return client

    def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self._process.sentinel, self._on_engine_exit)
        self._output_task = loop.create_task(self._output_loop())
        if self._heartbeat is not None:
            self._liveness_task = loop.create_task(self._liveness_loop())

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the engine core to stop, wait for it (then kill it), and close the sockets."""
        if not self.is_dead:
            self.is_dead, self.dead_reason = True, "shut down"
            # Not awaited: if the core already died (a signal to the whole process group),
            # the PUSH socket has no peer and an awaited send would wait forever.
            self._send(Shutdown())
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._process.sentinel)
        await asyncio.to_thread(_stop_process, self._process, timeout_s)
        for task in (self._output_task, self._liveness_task):
            if task is not None:
                task.cancel()
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._context.destroy(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    @property
    def model_config(self) -> ModelConfig:
        """The model's part of `config` (the plugin contract's EngineClient has it)."""
        return self.config.model

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs, one per engine step with new text or tokens.

        If the caller stops iterating before the request finished (aclose, cancellation,
        a disconnected client), the request is aborted in the engine."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        self.admission.check()  # RequestRejectedError when the queue is full
        state = RequestState.make(request_id, prompt_token_ids, params, self.tokenizer)
        # Encoded before the request is registered: a request that cannot be sent leaves
        # nothing behind in the in-flight table.
        message = self._encode(EngineCoreRequest(request_id, prompt_token_ids, params,
                                                 time.time()))
        self._requests[request_id] = state
        self._log_inputs(request_id, prompt_token_ids, params)
        self._input.send(message)
        try:
            while True:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished and self.request_logger is not None:
                    self.request_logger.log_output(request_id, item.text, item.token_ids,
                                                   item.finish_reason, len(prompt_token_ids))
                yield item
                if item.finished:
                    return
        finally:
            self._requests.pop(request_id, None)
            if not state.finished and not self.is_dead:
                self._send(AbortRequests([request_id]))

    async def encode(self, prompt_token_ids: list[int], params: PoolingParams,
                     request_id: str) -> PoolingRequestOutput:
        """Pool one prompt (task `embed`) and return its vector, or the error that ended
        it (`finish_reason` "error"). Cancelling the call aborts the request."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if request_id in self._requests or request_id in self._pooling:
            raise ValueError(f"request id {request_id!r} is already in flight")
        self.admission.check()
        future: asyncio.Future[PoolingRequestOutput] = \
            asyncio.get_running_loop().create_future()
        message = self._encode(EngineCoreRequest(request_id, prompt_token_ids,
                                                 _POOLING_SAMPLING, time.time(), params))
        self._pooling[request_id] = (prompt_token_ids, future)
        self._log_inputs(request_id, prompt_token_ids, params)
        self._input.send(message)
        try:
            return await future
        finally:
            if self._pooling.pop(request_id, None) is not None and not self.is_dead:
                self._send(AbortRequests([request_id]))

    async def abort(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        if state is not None and not self.is_dead:
            self._send(AbortRequests([request_id]))
            if not state.finished:
                state.finished = True
                state.queue.put_nowait(RequestOutput(
                    request_id, state.prompt_token_ids, state.detokenizer.output_text, "",
                    list(state.token_ids), [], True, "abort"))

    def plugin_reports(self) -> list[dict[str, Any]]:
        """The load-report records of the engine core and each of its workers."""
        return list(self._handshake.plugin_reports)

    def add_outputs_listener(self, callback: OutputsCallback) -> None:
        """Call `callback` with every batch of engine outputs (stat loggers use this)."""
        self._listeners.append(callback)

    def add_death_listener(self, callback: Callable[[], None]) -> None:
        """Call `callback` once, after the in-flight requests were failed, if the engine
        core dies (not when it is shut down)."""
        self._death_listeners.append(callback)

    def fail_inflight(self, error: BaseException) -> None:
        """Fail every request in flight with `error` (a data-parallel sibling died)."""
        self._fail_all(error)

    @property
    def num_inflight_requests(self) -> int:
        return len(self._requests) + len(self._pooling)

    def fail_requests(self, error: BaseException) -> int:
        """End every in-flight request with `error` now and abort them in the engine (the
        drain at shutdown); returns how many there were."""
        request_ids = list(self._requests) + list(self._pooling)
        self._fail_all(error)
        if request_ids and not self.is_dead:
            self._send(AbortRequests(request_ids))
        return len(request_ids)

    # ------------------------------------------------------------------ internals
    def _log_inputs(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        for hook in self.request_hooks:
            try:
                hook(request_id, len(prompt_token_ids), params)
            except Exception:
                logger.exception("A request hook raised (request %s).", request_id)
        if self.request_logger is None:
            return
        limit = self.request_logger.max_log_len
        ids = prompt_token_ids if limit is None else prompt_token_ids[:limit]
        prompt = self.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
        self.request_logger.log_inputs(request_id, prompt, prompt_token_ids, params)

    def _send(self, message: Any) -> None:
        # zmq.asyncio sends at once when the socket can; the returned future is not awaited
        # so an abort can be sent from a `finally` of a cancelled generator.
        self._input.send(self._encoder.encode(message))

    def _encode(self, request: EngineCoreRequest) -> bytes:
        """The request's bytes; InvalidParameterError naming the field when a value cannot
        be sent (text that is not valid Unicode, nesting too deep for the encoder)."""
        try:
            return self._encoder.encode(request)
        except (UnicodeError, RecursionError, ValueError, TypeError) as exc:
            raise InvalidParameterError(_unsendable_field(self._encoder, request),
                                        "a value of this field cannot be sent to the engine "
                                        f"({type(exc).__name__})") from None

    async def _output_loop(self) -> None:
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        while True:
            outputs = decoder.decode(await self._output.recv())
            self.liveness.on_progress()
            if outputs.scheduler_stats is not None:
                self.latest_stats = load = outputs.scheduler_stats
                # Every front end's requests (several API servers): fresher than a beat.
                self.liveness.num_engine_requests = load.num_running_reqs + \
                    load.num_waiting_reqs
            num_finished = 0
            for output in outputs.outputs:
                num_finished += output.finish_reason is not None
                if output.error_kind == "queue_timeout":
                    self._refuse(output.request_id, output.error or "queue timeout")
                    continue
                pooling = self._pooling.pop(output.request_id, None)
                if pooling is not None:
                    if not pooling[1].done():
                        pooling[1].set_result(
                            PoolingRequestOutput.from_engine(output, pooling[0]))
                    continue
                state = self._requests.get(output.request_id)
                if state is None or state.finished:
                    continue
                result = state.process(output)
                state.queue.put_nowait(result)
                if result.finished and result.finish_reason == "stop" \
                        and output.finish_reason != "stop":
                    # A stop string ended it: the engine stops it, counted as a "stop".
                    if self._count_stops:
                        self._stopped_here.add(output.request_id)
                    if output.finish_reason is None:
                        self._send(AbortRequests([output.request_id], "stop"))
            if num_finished:
                self.admission.note_finished(num_finished)
            if outputs.iteration_stats is not None:
                stats = outputs.iteration_stats
                if self._stopped_here:
                    for finished in stats.finished_requests:
                        if finished.request_id in self._stopped_here:
                            self._stopped_here.discard(finished.request_id)
                            finished.finish_reason = "stop"  # what the client was sent
                stats.n_params_iter = self.parent_requests.n_params(stats.finished_requests)
            for listener in self._listeners:
                try:
                    listener(outputs)
                except Exception:
                    logger.exception("An engine-outputs listener raised.")

    def _refuse(self, request_id: str, reason: str) -> None:
        """End a request the engine refused by its queue deadline with a 503's error."""
        waiting = self.latest_stats.num_waiting_reqs if self.latest_stats else 1
        error = self.admission.reject("queue_timeout", f"The request was not started in "
                                      f"time: {reason}; retry later.", waiting)
        pooling = self._pooling.pop(request_id, None)
        if pooling is not None and not pooling[1].done():
            pooling[1].set_exception(error)
        state = self._requests.get(request_id)
        if state is not None and not state.finished:
            state.finished = True  # the engine has dropped it: no abort to send
            state.queue.put_nowait(error)

    async def _liveness_loop(self) -> None:
        assert self._heartbeat is not None
        decoder = msgspec.msgpack.Decoder(EngineHeartbeat)
        while True:
            interval_ms = int(self.liveness.check_interval_s * 1000)
            while await self._heartbeat.poll(timeout=interval_ms):
                self.liveness.on_heartbeat(decoder.decode(await self._heartbeat.recv()))
                interval_ms = 0  # take every queued beat, then check
            self.liveness.check()

    def _on_engine_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        if self.is_dead:
            return
        self._process.join(timeout=1)  # the sentinel fires just before the exit is reapable
        self.is_dead = True
        self.dead_reason = f"the engine core (pid {self._process.pid}) exited with code " \
                           f"{self._process.exitcode}"
        logger.error("Engine died: %s; failing %d in-flight requests.", self.dead_reason,
                     len(self._requests))
        self._fail_all(EngineDeadError(self.dead_reason))
        for callback in self._death_listeners:
            try:
                callback()
            except Exception:
                logger.exception("An engine-death listener raised.")

    def _fail_all(self, error: BaseException) -> None:
        for _, future in self._pooling.values():
            if not future.done():
                future.set_exception(error)
        for state in list(self._requests.values()):
            if not state.finished:
                state.finished = True
                state.queue.put_nowait(error)


class EngineLauncher(Protocol):
    """How `EngineClient.start` starts an engine core: the addresses its sockets bind
    (`tcp://HOST:*` picks a free port), then the engine core, connected to the bound
    addresses, as a handle with the members of a `multiprocessing.Process` the client
    reads (`pid`, `sentinel`, `exitcode`, `is_alive`, `join`, `terminate`, `kill`)."""

    def addresses(self, ipc_dir: str) -> tuple[str, str, str]:
        """Input, output and heartbeat addresses to bind (`ipc_dir`: the client's folder)."""
        ...

    def start(self, config_bytes: bytes, input_addr: str, output_addr: str,
              heartbeat_addr: str) -> Any: ...


class SpawnedEngine:
    """The default launcher: the engine core as a child process (spawn), on ipc
    addresses in the client's private folder."""

    def addresses(self, ipc_dir: str) -> tuple[str, str, str]:
        return f"ipc://{ipc_dir}/input", f"ipc://{ipc_dir}/output", f"ipc://{ipc_dir}/heartbeat"

    def start(self, config_bytes: bytes, input_addr: str, output_addr: str,
              heartbeat_addr: str) -> Any:
        from gateway.engine.core_proc import run_engine_core  # light: imports no torch

        process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="gateway-engine-core",
            args=(config_bytes, input_addr, output_addr, os.getpid(), heartbeat_addr))
        process.start()
        return process


def _bind(socket: zmq.asyncio.Socket, address: str) -> str:
    """Bind `socket` to `address`; the address bound (a `*` port resolved)."""
    try:
        socket.bind(address)
    except zmq.ZMQError as exc:  # e.g. --data-parallel-address is not this machine's
        raise EngineStartError(f"cannot listen for the engine core at {address}: {exc}") \
            from None
    return bytes(socket.getsockopt(zmq.LAST_ENDPOINT)).decode()


async def _await_handshake(socket: zmq.asyncio.Socket, process: Any,
                           timeout_s: float) -> EngineHandshake:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await socket.poll(timeout=200):
            handshake = msgspec.msgpack.decode(await socket.recv(), type=EngineHandshake)
            if handshake.error is not None:
                raise EngineStartError(handshake.error)
            return handshake
        if not process.is_alive():
            raise EngineStartError(f"the engine core exited with code {process.exitcode} "
                                   "during start-up (see its log above)")
    raise EngineStartError(f"the engine core did not answer within {timeout_s:.0f} s")


def _stop_process(process: Any, timeout_s: float = 10.0) -> None:
    process.join(timeout=timeout_s)
    if process.is_alive():
        process.terminate()
        process.join(timeout=5)
    if process.is_alive():
        process.kill()
        process.join()


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
