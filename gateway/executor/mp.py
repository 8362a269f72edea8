"""Executor `mp` (engine-core process): one worker process per tensor-parallel rank.

The engine core spawns this node's ranks (other nodes start theirs with `gateway serve
--headless`) and talks to rank 0 alone, over a pipe. Each step's SchedulerOutput goes to
rank 0, which broadcasts it to every rank, local or remote, through torch.distributed;
rank 0 sends back the sampled tokens. Sampling is the same on every rank (same logits,
same seeds), so each rank keeps its copy of the batch in step without a second message.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import socket
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec

from gateway.config import ConfigurationError, EngineConfig
from gateway.executor.abstract import ExecutorDeadError
from gateway.logger import init_logger
from gateway.messages import ModelRunnerOutput, SchedulerOutput, WorkersReady
from gateway.worker.local_sync import LocalSync
from gateway.worker.worker_proc import FAILED, READY, SHUTDOWN, STEP, run_worker

logger = init_logger(__name__)

_SHUTDOWN_WAIT_S = 10.0  # workers get this long to leave after SHUTDOWN, then are killed


class MultiprocExecutor:
    """The engine core's side of the `mp` ranks. While it waits for rank 0 it also watches every
    local worker's sentinel: a worker that dies raises ExecutorDeadError at once, the other
    workers are killed, and the engine core exits (the front end's engine-death path does the
    rest). A remote rank's death reaches rank 0 as a failed collective, at the next step or
    keepalive.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = with_master_port(config)
        self.conn, rank0_conn = multiprocessing.Pipe()
        self.processes = start_worker_processes(self.config, rank0_conn)
        rank0_conn.close()  # rank 0 holds its end; EOF here then means rank 0 is gone
        self._is_shut_down = False
        self._encoder = msgspec.msgpack.Encoder()
        self._output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
        try:
            self.ready = self._await_ready()
        except BaseException:
            self.shutdown()
            raise
        self.num_kv_blocks = self.ready.num_kv_blocks
        self._log_ready()

    # ------------------------------------------------------------------ what it serves
    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return tuple(self.ready.supported_tasks)

    @property
    def max_model_len(self) -> int:
        return self.ready.max_model_len

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.ready.eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.ready.vocab_size

    @property
    def device_type(self) -> str:
        return self.ready.device_type

    @property
    def local_worker_pids(self) -> dict[str, int]:
        """{"worker-<rank>": pid} of the ranks on this host (for the process metrics)."""
        host = socket.gethostname()
        return {self.config.parallel.worker_role(s.rank): s.pid for s in self.ready.statuses
                if s.host == host}

    def plugin_reports(self) -> list[dict[str, Any]]:
        """Every rank's records (remote ranks' too: they reached rank 0 at start-up)."""
        return [dict(record) for status in self.ready.statuses
                for record in status.plugin_reports]

    # ------------------------------------------------------------------ steps
    _sender: _StepSender | None = None  # --async-scheduling: started by the first submit

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._send(STEP + self._encoder.encode(scheduler_output))
        return self._decode_output(self._receive())

    def submit_step(self, scheduler_output: SchedulerOutput) -> None:
        """Hand the step to the sender thread: rank 0 reads it once its current step is
        done, and a large step would block this thread on a full pipe meanwhile."""
        if self._sender is None:
            self._sender = _StepSender(self.conn)
        self._sender.send(STEP + self._encoder.encode(scheduler_output))

    def take_step(self) -> ModelRunnerOutput:
        if self._sender is not None and self._sender.error is not None:
            raise ExecutorDeadError(self._dead_reason("worker rank 0 is gone"))
        return self._decode_output(self._receive())

    def _decode_output(self, reply: bytes) -> ModelRunnerOutput:
        if reply[:1] == FAILED:
            raise ExecutorDeadError(self._dead_reason(
                f"worker rank 0 failed a step: {reply[1:].decode(errors='replace')}"))
        return self._output_decoder.decode(reply[1:])

    def check_health(self) -> None:
        if any(not process.is_alive() for process in self.processes):
            raise ExecutorDeadError(self._dead_reason("a worker exited"))

    def shutdown(self) -> None:
        """Ask the ranks to stop (all of them, through rank 0), wait, then kill what is
        left; at once when a worker already died (the others may be stuck in a collective)."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        if self._sender is not None:
            self._sender.close()  # (its last step is sent before SHUTDOWN)
        if all(process.is_alive() for process in self.processes):
            try:
                self.conn.send_bytes(SHUTDOWN)
            except OSError:
                pass
            deadline = time.monotonic() + _SHUTDOWN_WAIT_S
            for process in self.processes:
                process.join(max(0.0, deadline - time.monotonic()))
        stop_processes(self.processes)
        self.conn.close()

    # ------------------------------------------------------------------ internals
    def _send(self, message: bytes) -> None:
        try:
            self.conn.send_bytes(message)
        except OSError:
            raise ExecutorDeadError(self._dead_reason("worker rank 0 is gone")) from None

    def _receive(self) -> bytes:
        """Rank 0's next message; ExecutorDeadError as soon as any local worker exits."""
        ready = wait([self.conn, *(process.sentinel for process in self.processes)])
        # A worker exited; rank 0 may still say why (its collective failed): a moment.
        if self.conn not in ready and not self.conn.poll(0.1):
            raise ExecutorDeadError(self._dead_reason("a worker exited"))
        try:
            return self.conn.recv_bytes()
        except EOFError:
            raise ExecutorDeadError(self._dead_reason("worker rank 0 closed its pipe")) \
                from None

    def _await_ready(self) -> WorkersReady:
        try:
            reply = self._receive()
        except ExecutorDeadError as exc:
            raise RuntimeError(f"the workers did not start: {exc} (see their log above)") \
                from None
        assert reply[:1] == READY, reply[:1]
        ready = msgspec.msgpack.decode(reply[1:], type=WorkersReady)
        if ready.error is not None:
            raise (ConfigurationError if ready.is_configuration_error else RuntimeError)(
                ready.error)
        return ready

    def _dead_reason(self, default: str) -> str:
        wait([process.sentinel for process in self.processes], timeout=0.2)  # reaped yet?
        dead = [describe_exit(process) for process in self.processes
                if not process.is_alive()]
        return "; ".join(dead) if dead else default

    def _log_ready(self) -> None:
        parallel = self.config.parallel
        ranks = ", ".join(f"rank {s.rank} pid {s.pid} on {s.host}" for s in self.ready.statuses)
        logger.info("Tensor parallel over %d ranks on %d node(s), rendezvous %s:%d: %s",
                    parallel.tensor_parallel_size, parallel.nnodes, parallel.master_addr,
                    parallel.master_port, ranks)
        logger.info("KV cache: %d blocks of %d tokens on every rank (the fewest any rank's "
                    "budget holds; budgets hold %s)", self.num_kv_blocks,
                    self.config.cache.block_size,
                    [s.num_kv_blocks for s in self.ready.statuses])


class _StepSender:
    """A thread that writes the submitted steps to rank 0's pipe, in order."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.error: OSError | None = None  # set once a write failed: rank 0 is gone
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="gateway-step-sender")
        self._thread.start()

    def send(self, message: bytes) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(_SHUTDOWN_WAIT_S)

    def _run(self) -> None:
        while (message := self._queue.get()) is not None:
            if self.error is not None:
                continue
            try:
                self.conn.send_bytes(message)
            except OSError as exc:
                self.error = exc


# ------------------------------------------------------------------ shared with headless
def with_master_port(config: EngineConfig) -> EngineConfig:
    """`config` with a rendezvous port: the operator's, or one free right now."""
    parallel = config.parallel
    if parallel.master_port is not None:
        return config
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((parallel.master_addr, 0))
        port = int(probe.getsockname()[1])
    return msgspec.structs.replace(
        config, parallel=msgspec.structs.replace(parallel, master_port=port))


def start_worker_processes(config: EngineConfig,
                           rank0_conn: Connection | None) -> list[BaseProcess]:
    """Spawn this node's ranks. Daemonic: they cannot outlive this process's exit. When
    they are all the ranks, they get semaphores to meet in shared memory (CPU)."""
    parallel = config.parallel
    first = parallel.node_rank * parallel.ranks_per_node
    context = multiprocessing.get_context("spawn")
    local_sync = (LocalSync(context, parallel.tensor_parallel_size)
                  if parallel.nnodes == 1 and parallel.tensor_parallel_size > 1 else None)
    config_bytes = msgspec.msgpack.encode(config)
    processes: list[BaseProcess] = []
    for rank in range(first, first + parallel.ranks_per_node):
        process = context.Process(
            target=run_worker, name=f"gateway-worker-{rank}", daemon=True,
            args=(config_bytes, rank, rank0_conn if rank == 0 else None, os.getpid(),
                  local_sync))
        process.start()
        process.rank = rank  # type: ignore[attr-defined]
        # Held while the process lives: a collected semaphore's name is unlinked, and a
        # child still starting could not open it.
        process.local_sync = local_sync  # type: ignore[attr-defined]
        processes.append(process)
    return processes


def stop_processes(processes: list[BaseProcess]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join()


def describe_exit(process: BaseProcess) -> str:
    code = process.exitcode
    how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
           else f"exited with code {code}")
    return f"worker rank {getattr(process, 'rank', '?')} (pid {process.pid}) {how}"
