"""Data parallelism (front-end process): N engine cores behind one engine client.

`gateway serve --data-parallel-size N` (vLLM's flag) starts N engine-core processes, each
with its own executor, worker(s) and tensor-parallel group, its own KV cache and scheduler,
holding a whole copy of the model; with `--data-parallel-backend ray` each engine core is
a Ray actor instead (engine/ray_engines.py), placed by the Ray cluster.

`DataParallelEngineClient` answers the EngineClient surface (generate, encode, abort, the
handshake's facts, listeners) and sends each new request to the engine the load balancer
picks (dp_balance.py); a request stays on its engine until it ends, and its abort goes
there too.

Each engine stamps its index on the outputs it sends (`EngineCoreOutputs.engine_index`), so
the stat loggers keep one set per engine and the Prometheus series carry `engine="<i>"`.

An engine that dies ends the whole server as one engine's death does: every request in
flight on every engine fails at once, `is_dead` turns True (/health answers 503), and the
death listeners run, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any, cast

import msgspec

from gateway.config import EngineConfig, ModelConfig
from gateway.frontend.engine_client.balance import LoadBalancer
from gateway.frontend.engine_client.client import (
    EngineClient,
    EngineDeadError,
    EngineStartError,
    OutputsCallback,
    PoolingRequestOutput,
    RequestOutput,
)
from gateway.frontend.http.request_logger import RequestLogger
from gateway.logger import init_logger
from gateway.messages import EngineCoreOutputs
from gateway.models.info.paths import ModelInfo
from gateway.pooling_params import PoolingParams
from gateway.ray_cluster import RayCluster
from gateway.sampling_params import SamplingParams

logger = init_logger(__name__)

async def start_engine_client(config: EngineConfig, startup_timeout_s: float = 900.0,
                              model_info: ModelInfo | None = None) -> AnyEngineClient:
    """The engine client `config` asks for: one engine core, or a data-parallel set."""
    parallel = config.parallel
    if parallel.data_parallel_size > 1 or parallel.data_parallel_backend == "ray":
        return await DataParallelEngineClient.start(config, startup_timeout_s, model_info)
    return await EngineClient.start(config, startup_timeout_s, model_info)


def engine_config_for_rank(config: EngineConfig, rank: int) -> EngineConfig:
    """Engine `rank`'s configuration: its index, and its own rendezvous port when the
    operator fixed one (engine r uses --master-port + r; else each picks a free one)."""
    parallel = config.parallel
    port = None if parallel.master_port is None else parallel.master_port + rank
    return msgspec.structs.replace(config, parallel=msgspec.structs.replace(
        parallel, data_parallel_rank=rank, master_port=port))


class DataParallelEngineClient:
    """The front end's handle on several engine cores (see the module doc)."""

    def __init__(self, config: EngineConfig, engines: list[EngineClient],
                 cluster: RayCluster | None = None) -> None:
        first = engines[0]
        self.config = config
        self.engines = engines
        self._cluster = cluster  # the Ray cluster the engines run on (-dpb ray), left at exit
        self.tokenizer = first.tokenizer
        self.model_info = first.model_info
        self.model_name = first.model_name
        self.supported_tasks = first.supported_tasks
        self.max_model_len = min(engine.max_model_len for engine in engines)
        self.num_kv_blocks = first.num_kv_blocks  # per engine: each has its own cache
        self.block_size = first.block_size
        self.vocab_size = first.vocab_size
        self.engine_pid = first.engine_pid
        #: Every engine's processes by role (engine-core-dp<i>, worker-dp<i>-<rank>): pid.
        self.process_pids: dict[str, int] = {
            role: pid for engine in engines for role, pid in engine.process_pids.items()}
        self.is_dead = False
        self.dead_reason: str | None = None
        self.balancer = LoadBalancer(len(engines))
        #: Shared with every engine's client: called as each request is sent.
        self.request_hooks: list[Callable[[str, int, Any], None]] = []
        self._owners: dict[str, int] = {}  # request id -> the engine serving it
        self._death_listeners: list[Callable[[], None]] = []
        #: The reliability surface (reliability.py, /health, the drain) over every engine.
        self.liveness = AllEnginesLiveness(engines)
        self.admission = AllEnginesAdmission(engines)
        #: Shared, so `vllm:request_params_n` counts fanned-out requests on any engine.
        self.parent_requests = first.parent_requests
        for index, engine in enumerate(engines):
            engine.parent_requests = self.parent_requests
            engine.request_hooks = self.request_hooks
            engine.add_outputs_listener(functools.partial(self._on_outputs, index))
            engine.add_death_listener(functools.partial(self._on_engine_death, index))

    # ------------------------------------------------------------------ start and stop
    @classmethod
    async def start(cls, config: EngineConfig, startup_timeout_s: float = 900.0,
                    model_info: ModelInfo | None = None) -> DataParallelEngineClient:
        """Start every engine core at once; if one cannot start, stop the others and raise
        its EngineStartError (naming the engine)."""
        size = config.parallel.data_parallel_size
        if config.parallel.data_parallel_backend == "ray":
            from gateway.frontend.engine_client.ray_engines import start_ray_engines

            cluster, engines = await start_ray_engines(config, startup_timeout_s, model_info)
            return cls(config, engines, cluster)
        engines = await start_all([EngineClient.start(
            engine_config_for_rank(config, rank), startup_timeout_s, model_info)
            for rank in range(size)])
        logger.info("Data parallel: %d engine cores (pids %s), requests balanced on their "
                    "reported load.", size, ", ".join(str(e.engine_pid) for e in engines))
        return cls(config, engines)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every engine core (at once) and close their sockets; then leave the Ray
        cluster they ran on, if any."""
        if not self.is_dead:
            self.is_dead, self.dead_reason = True, "shut down"
        await asyncio.gather(*(engine.shutdown(timeout_s) for engine in self.engines))
        if self._cluster is not None:
            await asyncio.to_thread(self._cluster.leave)

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model

    @property
    def request_logger(self) -> RequestLogger | None:
        return self.engines[0].request_logger

    @request_logger.setter
    def request_logger(self, value: RequestLogger | None) -> None:
        for engine in self.engines:
            engine.request_logger = value

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """EngineClient.generate on the engine the balancer picks."""
        engine = self._assign(request_id)
        # Closed explicitly: leaving `async for` early does not close the inner generator,
        # and its `finally` is what aborts the request in the engine.
        stream = cast(AsyncGenerator[RequestOutput, None],
                      engine.generate(prompt_token_ids, params, request_id))
        try:
            async with contextlib.aclosing(stream):
                async for output in stream:
                    yield output
        finally:
            self._owners.pop(request_id, None)

    async def encode(self, prompt_token_ids: list[int], params: PoolingParams,
                     request_id: str) -> PoolingRequestOutput:
        """EngineClient.encode on the engine the balancer picks."""
        engine = self._assign(request_id)
        try:
            return await engine.encode(prompt_token_ids, params, request_id)
        finally:
            self._owners.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        index = self._owners.get(request_id)
        if index is not None:
            await self.engines[index].abort(request_id)

    def plugin_reports(self) -> list[dict[str, Any]]:
        """Every engine core's and worker's load-report records."""
        return [record for engine in self.engines for record in engine.plugin_reports()]

    def add_outputs_listener(self, callback: OutputsCallback) -> None:
        """Call `callback` with every engine's batches (each names its `engine_index`)."""
        for engine in self.engines:
            engine.add_outputs_listener(callback)

    def add_death_listener(self, callback: Callable[[], None]) -> None:
        """Call `callback` once, after every in-flight request failed, when any engine
        core dies (not when they are shut down)."""
        self._death_listeners.append(callback)

    @property
    def num_inflight_requests(self) -> int:
        return sum(engine.num_inflight_requests for engine in self.engines)

    def fail_requests(self, error: BaseException) -> int:
        """End every engine's in-flight requests with `error` (the drain at shutdown)."""
        return sum(engine.fail_requests(error) for engine in self.engines)

    # ------------------------------------------------------------------ internals
    def _assign(self, request_id: str) -> EngineClient:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if request_id in self._owners:
            raise ValueError(f"request id {request_id!r} is already in flight")
        index = self.balancer.choose()
        self._owners[request_id] = index
        return self.engines[index]

    def _on_outputs(self, index: int, outputs: EngineCoreOutputs) -> None:
        if outputs.scheduler_stats is not None:
            self.balancer.report(index, outputs.scheduler_stats)

    def _on_engine_death(self, index: int) -> None:
        if self.is_dead:
            return
        self.is_dead = True
        self.dead_reason = f"data-parallel engine {index}: {self.engines[index].dead_reason}"
        error = EngineDeadError(self.dead_reason)
        for engine in self.engines:
            engine.fail_inflight(error)
        logger.error("Engine %d died; every engine's requests failed.", index)
        for callback in self._death_listeners:
            try:
                callback()
            except Exception:
                logger.exception("An engine-death listener raised.")


async def start_all(starts: list[Coroutine[Any, Any, EngineClient]]) -> list[EngineClient]:
    """Await every engine client's start (or connection) at once, in rank order. If one
    cannot start, shut down those that did and raise its EngineStartError, naming the
    engine (`data-parallel engine 1 of 2: ...`) when there are several."""
    size = len(starts)
    tasks = [asyncio.ensure_future(start) for start in starts]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException as exc:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        started = [t.result() for t in tasks if not t.cancelled() and t.exception() is None]
        await asyncio.gather(*(engine.shutdown() for engine in started),
                             return_exceptions=True)
        if isinstance(exc, EngineStartError) and size > 1:
            failed = next(rank for rank, task in enumerate(tasks)
                          if not task.cancelled() and task.exception() is exc)
            raise EngineStartError(f"data-parallel engine {failed} of {size}: {exc}") \
                from None
        raise


#: What `start_engine_client` returns: one engine core's client, or several behind one.
AnyEngineClient = EngineClient | DataParallelEngineClient


class AllEnginesLiveness:
    """The engines' liveness (engine/liveness.py) as one: stalled while any engine is, with
    that engine named in the reason; the threshold applies to each."""

    def __init__(self, engines: list[EngineClient]) -> None:
        self._engines = engines

    @property
    def stall_threshold_s(self) -> float:
        return self._engines[0].liveness.stall_threshold_s

    @stall_threshold_s.setter
    def stall_threshold_s(self, value: float) -> None:
        for engine in self._engines:
            engine.liveness.stall_threshold_s = value

    @property
    def stalled_reason(self) -> str | None:
        for index, engine in enumerate(self._engines):
            if engine.liveness.stalled_reason is not None:
                return f"data-parallel engine {index}: {engine.liveness.stalled_reason}"
        return None

    @property
    def is_stalled(self) -> bool:
        return self.stalled_reason is not None


class AllEnginesAdmission:
    """`--max-num-queued-reqs` for each engine (each caps its own waiting and running
    requests, as each vLLM engine does), with one list of rejection listeners."""

    def __init__(self, engines: list[EngineClient]) -> None:
        self._engines = engines
        self.rejection_listeners: list[Callable[[str], None]] = []
        for engine in engines:
            engine.admission.rejection_listeners = self.rejection_listeners

    @property
    def max_num_queued_reqs(self) -> int | None:
        return self._engines[0].admission.max_num_queued_reqs

    @max_num_queued_reqs.setter
    def max_num_queued_reqs(self, value: int | None) -> None:
        for engine in self._engines:
            engine.admission.max_num_queued_reqs = value
