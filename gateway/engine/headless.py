"""`gateway serve --headless` (a process of its own, on a node other than node 0): a node
that runs only its own worker ranks.

With `--nnodes M`, node 0 runs the server, the engine core and ranks 0 .. N/M - 1; node K
runs `gateway serve --headless --node-rank K` with the same model and flags, which starts
ranks K * N/M .. (K + 1) * N/M - 1 here. They join rank 0's rendezvous at
--master-addr:--master-port and then receive every step from rank 0 through
torch.distributed, as the local ranks do. Imports nothing heavy at module level (the CLI
imports it).
"""

from __future__ import annotations

import signal
from multiprocessing.connection import wait

from gateway.config import EngineConfig
from gateway.logger import init_logger
from gateway.plugins import start_process

logger = init_logger(__name__)


def run_headless(config: EngineConfig) -> int:
    """Start this node's ranks and wait for them; returns the exit code: 0 when the engine
    core shut them down, 1 as soon as one of them fails (the others are killed then). Stops
    them on SIGINT/SIGTERM.
    """
    from gateway.executor.mp import describe_exit, start_worker_processes, stop_processes

    start_process("headless")
    parallel = config.parallel
    first = parallel.node_rank * parallel.ranks_per_node
    logger.info("Headless node %d of %d: ranks %d..%d of %d, rendezvous %s:%s",
                parallel.node_rank, parallel.nnodes, first, first + parallel.ranks_per_node - 1,
                parallel.tensor_parallel_size, parallel.master_addr, parallel.master_port)
    stopping: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    processes = start_worker_processes(config, None)
    try:
        pending = list(processes)
        while pending and not stopping:
            wait([process.sentinel for process in pending], timeout=0.5)
            for process in [p for p in pending if not p.is_alive()]:
                pending.remove(process)
                if process.exitcode != 0:
                    logger.error("%s; stopping this node's other ranks.",
                                 describe_exit(process))
                    return 1
        if stopping:
            logger.info("Received %s; stopping this node's ranks.",
                        signal.Signals(stopping[0]).name)
        else:
            logger.info("This node's ranks have finished (the engine core shut them down).")
        return 0
    finally:
        stop_processes(processes)
