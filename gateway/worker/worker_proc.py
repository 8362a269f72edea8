"""The worker process shell: one tensor-parallel rank around a plain Worker.

Messages between the engine core and rank 0 travel over a pipe, each a kind byte then a
body: to rank 0, STEP + SchedulerOutput, or SHUTDOWN; from rank 0, READY + WorkersReady
once, then OUTPUT + ModelRunnerOutput per step, or FAILED + the error text. Rank 0
broadcasts what it receives to every rank (KEEPALIVE too, while the engine core is idle, so
that no rank's wait reaches the collective timeout), and every rank runs each step.

Imports nothing heavy at module level: the engine core names `run_worker` as the spawn
target and does not need torch itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, TypeVar

import msgspec

from gateway import envs, gc_stats
from gateway.config import ConfigurationError, EngineConfig
from gateway.messages import WorkersReady, WorkerStatus
from gateway.worker.local_sync import LocalSync

if TYPE_CHECKING:
    from gateway.plugins import PluginError
    from gateway.worker.distributed import TensorParallelGroup
    from gateway.worker.worker import Worker

STEP, SHUTDOWN, KEEPALIVE = b"S", b"Q", b"K"
READY, OUTPUT, FAILED = b"R", b"O", b"E"
KEEPALIVE_INTERVAL_S = 10.0
_PR_SET_PDEATHSIG = 1
_T = TypeVar("_T")


class StartupFailed(Exception):
    """A rank could not start; every rank stops (the message names the ranks)."""


def run_worker(config_bytes: bytes, rank: int, engine_conn: Connection | None,
               parent_pid: int, local_sync: LocalSync | None = None) -> None:
    """Entry point of a spawned worker process (rank 0 holds `engine_conn`; `local_sync`
    is given when every rank runs on this machine).

    1. Name the process worker-<rank>; it ends when the process that started it does.
       Load the general plugins, before torch.distributed is touched (a plugin may set
       process-group options); a plugin that raises fails this rank's first phase below.
    2. Join the ranks' control group (the rendezvous at master_addr:master_port).
    3. Start the Worker in phases; after each, the ranks exchange statuses, so that a
       failure on any rank stops them all and rank 0 can tell the engine core why.
    4. Loop: rank 0 takes a message from the engine core and broadcasts it; every rank
       runs the step; rank 0 sends the output back.
    """
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    role = config.parallel.worker_role(rank)  # worker-<rank>, or worker-dp<d>-<rank>
    os.environ["GATEWAY_PROCESS_ROLE"] = role
    envs.default_openmp_waiting()  # before torch loads
    _end_with_parent(parent_pid)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    from gateway.logger import init_logger

    plugin_error = start_rank(role, publish_gc_stats=True)
    from gateway.worker.distributed import TensorParallelGroup

    logger = init_logger("gateway.worker.worker_proc")
    parallel = config.parallel
    try:
        group = TensorParallelGroup.join(rank, parallel)
    except Exception as exc:  # port taken, address unreachable, rendezvous timeout
        error = (f"worker rank {rank} (pid {os.getpid()}) could not join the rendezvous at "
                 f"{parallel.master_addr}:{parallel.master_port}: {type(exc).__name__}: {exc}")
        logger.error("%s", error)
        if engine_conn is not None:
            engine_conn.send_bytes(READY + msgspec.msgpack.encode(
                WorkersReady(statuses=[], error=error)))
        raise SystemExit(1) from None
    try:
        worker = _start(config, group, engine_conn, local_sync, plugin_error)
    except StartupFailed as exc:
        logger.error("Worker rank %d stops: %s", rank, exc)
        group.close()
        raise SystemExit(1) from None
    try:
        _loop(worker, group, engine_conn)
    except SystemExit:
        raise
    except BaseException:
        logger.error("Worker rank %d failed:\n%s", rank, traceback.format_exc())
        raise SystemExit(1) from None
    group.close()


def _start(config: EngineConfig, group: TensorParallelGroup, engine_conn: Connection | None,
           local_sync: LocalSync | None, plugin_error: Exception | None = None) -> Worker:
    from gateway.platforms import get_current_platform
    from gateway.worker.worker import Worker

    worker = Worker(config, group.rank, tp=group)
    status = WorkerStatus(rank=group.rank, pid=os.getpid(), host=socket.gethostname())
    if plugin_error is not None:
        status.error = f"{type(plugin_error).__name__}: {plugin_error}"
    _run_phase(worker.init_device, status)  # platform, threads (general plugins ran)
    _agree(group, status, engine_conn)
    assert worker.device is not None
    group.use_device(get_current_platform().dist_backend, worker.device, local_sync,
                     _largest_collective_bytes(worker))
    _run_phase(worker.load_model, status)  # this rank's shard; sampler, logits processors
    if worker.sizes_kv_cache_by_profiling:  # a step of every rank: all must have loaded
        _agree(group, status, engine_conn)
    if status.error is None:
        status.num_kv_blocks = _guarded(worker.num_kv_blocks_in_budget, status) or 0
    statuses = _agree(group, status, engine_conn)
    num_kv_blocks = min(s.num_kv_blocks for s in statuses)
    worker.initialize_kv_cache(num_kv_blocks)
    if engine_conn is not None:
        engine_conn.send_bytes(READY + msgspec.msgpack.encode(WorkersReady(
            statuses=statuses, num_kv_blocks=num_kv_blocks,
            supported_tasks=list(worker.supported_tasks), max_model_len=worker.max_model_len,
            eos_token_ids=list(worker.eos_token_ids), vocab_size=worker.vocab_size,
            device_type=worker.device_type)))
    return worker


def _largest_collective_bytes(worker: Worker) -> int:
    """The largest tensor a step all-reduces or all-gathers, at 4 bytes an element: the
    hidden states of a full step's tokens, or one rank's logits of every sampled request."""
    info, config = worker.info, worker.config
    assert info is not None
    vocab_part = -(-info.vocab_size // config.parallel.tensor_parallel_size)
    return 4 * max(config.scheduler.max_num_batched_tokens * info.hidden_size,
                   config.scheduler.max_num_seqs * vocab_part)


def _run_phase(phase: Callable[[], object], status: WorkerStatus) -> None:
    if status.error is None:
        _guarded(phase, status)


def _guarded(call: Callable[[], _T], status: WorkerStatus) -> _T | None:
    """`call()`, or None with the error in `status` (and the traceback in the log)."""
    try:
        return call()
    except Exception as exc:
        status.error = f"{type(exc).__name__}: {exc}"
        status.is_configuration_error = isinstance(exc, ConfigurationError)
        from gateway.logger import init_logger
        init_logger(__name__).error("Rank %d failed to start:%s", status.rank, f" {exc}"
                                    if status.is_configuration_error
                                    else f"\n{traceback.format_exc()}")
        return None


def _agree(group: TensorParallelGroup, status: WorkerStatus,
           engine_conn: Connection | None) -> list[WorkerStatus]:
    """Every rank's status (with this rank's load report so far); StartupFailed, on every
    rank, when any failed."""
    from gateway.plugins import load_report

    status.plugin_reports = load_report().to_dicts()
    decoder = msgspec.msgpack.Decoder(WorkerStatus)
    statuses = [decoder.decode(raw) for raw in
                group.all_gather_bytes(msgspec.msgpack.encode(status))]
    failed = [s for s in statuses if s.error is not None]
    if not failed:
        return statuses
    error = _describe_failures(failed)
    if engine_conn is not None:
        engine_conn.send_bytes(READY + msgspec.msgpack.encode(
            WorkersReady(statuses=statuses, error=error, is_configuration_error=all(
                s.is_configuration_error for s in failed))))
    raise StartupFailed(error)


def _describe_failures(failed: list[WorkerStatus]) -> str:
    """One sentence per distinct error, naming the ranks that hit it."""
    by_error: dict[str, list[WorkerStatus]] = {}
    for status in failed:
        by_error.setdefault(status.error or "", []).append(status)
    return "; ".join(
        f"worker rank{'s' if len(ranks) > 1 else ''} "
        + ", ".join(f"{s.rank} (pid {s.pid} on {s.host})" for s in ranks)
        + f" failed to start: {error}" for error, ranks in by_error.items())


def _loop(worker: Worker, group: TensorParallelGroup, engine_conn: Connection | None) -> None:
    from gateway.messages import SchedulerOutput

    decoder = msgspec.msgpack.Decoder(SchedulerOutput)
    encoder = msgspec.msgpack.Encoder()
    while True:
        message = group.broadcast_bytes(
            _next_message(engine_conn) if engine_conn is not None else None)
        kind, body = message[:1], message[1:]
        if kind == SHUTDOWN:
            return
        if kind == KEEPALIVE:
            continue
        try:
            output = worker.execute_model(decoder.decode(body))
        except Exception as exc:
            # The ranks may no longer be in step with each other: this rank stops, and the
            # engine core, seeing it gone (or told by rank 0), stops the others.
            if engine_conn is not None:
                engine_conn.send_bytes(FAILED + f"{type(exc).__name__}: {exc}".encode())
            raise
        if engine_conn is not None:
            engine_conn.send_bytes(OUTPUT + encoder.encode(output))


def _next_message(engine_conn: Connection) -> bytes:
    """The engine core's next message (KEEPALIVE after an idle interval; SHUTDOWN when the
    engine core is gone, so that every rank stops)."""
    try:
        if not engine_conn.poll(KEEPALIVE_INTERVAL_S):
            return KEEPALIVE
        return engine_conn.recv_bytes()
    except (EOFError, OSError):
        return SHUTDOWN


def start_rank(role: str, publish_gc_stats: bool = False) -> PluginError | None:
    """Take this rank's process role and load the general plugins (before torch.distributed
    is touched); returns the plugin error, which the ranks' first agreement reports."""
    from gateway.plugins import PluginError, start_process
    from gateway.process_start import load_process_plugins

    start_process(role)
    if publish_gc_stats:
        gc_stats.publish()
    try:
        load_process_plugins()
    except PluginError as exc:
        return exc
    return None


def _end_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent (engine core or headless launcher) dies, even
    by SIGKILL (Linux prctl PR_SET_PDEATHSIG); exit now if it is already gone."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        raise SystemExit(1)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(0)
