"""The engine-core process shell: sockets, signals and the loop around EngineCore.

Imports nothing heavy at module level: the front end imports this module to name the
spawn target, and must not import torch.
"""

from __future__ import annotations

import os
import signal
import traceback

import msgspec
import zmq

from gateway.config import EngineConfig
from gateway.messages import (
    AbortRequests,
    EngineCoreInput,
    EngineCoreRequest,
    EngineHandshake,
    Shutdown,
)

_IDLE_POLL_MS = 1000  # while idle, check this often that the front end is still alive


def run_engine_core(config_bytes: bytes, input_addr: str, output_addr: str,
                    parent_pid: int) -> None:
    """Entry point of the spawned engine-core process.

    1. Name the process and load the general plugins (before the executor is made).
    2. Build the EngineCore and answer the handshake (or send why it could not start).
    3. Loop: take input (blocking only while idle, checking the workers' health), step,
       send outputs. A dead worker ends the process with code 1.
    """
    os.environ["GATEWAY_PROCESS_ROLE"] = "engine-core"
    # Before torch loads: OpenMP threads that spin while waiting stall for whole time
    # slices when the front end (or anything else) takes a core; passive waiting keeps a
    # step's time steady. An operator's own OMP_WAIT_POLICY wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from gateway.logger import init_logger
    from gateway.plugins import load_general_plugins, start_process

    start_process("engine-core")
    logger = init_logger("gateway.engine.core_proc")
    signal.signal(signal.SIGTERM, _exit_on_signal)
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_addr)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        load_general_plugins()
        from gateway.engine.core import EngineCore
        core = EngineCore(msgspec.msgpack.decode(config_bytes, type=EngineConfig))
    except BaseException as exc:
        logger.error("Engine core failed to start:\n%s", traceback.format_exc())
        outputs.send(encoder.encode(_failed_handshake(exc)))
        outputs.close(linger=5000)
        inputs.close(linger=0)  # term() waits for every socket to close
        context.term()
        raise SystemExit(1) from None
    outputs.send(encoder.encode(core.handshake(os.getpid())))
    from gateway.executor import ExecutorDeadError
    try:
        _loop(core, inputs, outputs, encoder, parent_pid)
    except SystemExit:
        pass
    except ExecutorDeadError as exc:
        logger.error("The engine core stops: %s", exc)
        raise SystemExit(1) from None
    finally:
        core.shutdown()
        context.destroy(linger=0)


def _loop(core, inputs: zmq.Socket, outputs: zmq.Socket,  # type: ignore[no-untyped-def]
          encoder: msgspec.msgpack.Encoder, parent_pid: int) -> None:
    decoder = msgspec.msgpack.Decoder(EngineCoreInput)
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    was_busy = False
    while True:
        timeout = 0 if core.has_work() else _IDLE_POLL_MS
        if not poller.poll(timeout) and timeout:
            if os.getppid() != parent_pid:
                return  # the front end is gone: nothing to serve
            core.check_health()  # a worker process that died while idle ends the core
        errors = []
        while True:
            try:
                message = decoder.decode(inputs.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            if isinstance(message, EngineCoreRequest):
                error = core.add_request(message)
                if error is not None:
                    errors.append(error)
            elif isinstance(message, AbortRequests):
                core.abort_requests(message.request_ids, message.reason)
            elif isinstance(message, Shutdown):
                return
        busy = core.has_work()
        if busy:
            result = core.step()
            result.outputs[:0] = errors
        elif errors or was_busy:  # say so once when the engine goes idle (stats drop to 0)
            result = core.make_outputs(errors)
        else:
            continue
        outputs.send(encoder.encode(result))
        was_busy = busy


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _failed_handshake(exc: BaseException) -> EngineHandshake:
    return EngineHandshake(supported_tasks=[], max_model_len=0, num_kv_blocks=0, block_size=0,
                           eos_token_ids=[], vocab_size=0, plugin_reports=[], pid=os.getpid(),
                           error=f"{type(exc).__name__}: {exc}")
