"""The Ray cluster, as every process of the gateway that places actors sees it (any process).

Two places put work on Ray: the engine core places its tensor-parallel ranks
(`--distributed-executor-backend ray`, executor/ray.py), and the front end places the
data-parallel engine cores (`--data-parallel-backend ray`, engine/ray_engines.py). Both
join the cluster here, the same way, and watch their actors through the same handle.

`RayCluster.join()` connects to the cluster that RAY_ADDRESS names (`ray start --head` and
its address, or an existing cluster), or starts a local one when none is named; inside a
Ray actor (an engine core that is itself an actor) Ray is connected already and that
connection is used. The actors get this process's PYTHONPATH and its VLLM_*, GATEWAY_* and
HF_* variables, so plugins are found and allowed there as here.

Imports Ray only inside functions: importing this module costs nothing.
"""

from __future__ import annotations

import os
import socket
import threading
from multiprocessing.connection import wait
from typing import Any

from gateway.logger import init_logger

logger = init_logger(__name__)

_FORWARDED_PREFIXES = ("VLLM_", "GATEWAY_", "HF_")


class RayCluster:
    """This process's connection to the Ray cluster; `leave()` ends it only when `join()`
    made it (an actor leaves its worker's connection alone)."""

    def __init__(self, ray: Any, is_joined_here: bool) -> None:
        self.ray = ray
        self.is_joined_here = is_joined_here

    @classmethod
    def join(cls) -> RayCluster:
        # Ray folds identical lines of several actors into one ("[repeated 2x across
        # cluster]"), so one rank's plugin and load lines would hide another's: every
        # actor's lines reach the log as they are unless the operator chose otherwise.
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        import ray

        if ray.is_initialized():
            return cls(ray, is_joined_here=False)
        # A local cluster of our own needs no dashboard; an operator's has its own.
        local: dict[str, Any] = {} if os.environ.get("RAY_ADDRESS") else {
            "include_dashboard": False}
        ray.init(runtime_env={"env_vars": forwarded_env()}, **local)
        return cls(ray, is_joined_here=True)

    @property
    def node_ip(self) -> str:
        """This node's address as the cluster knows it (where actors reach this process)."""
        return str(self.ray.util.get_node_ip_address())

    def on_this_node(self) -> Any:
        """A scheduling strategy that places an actor on this node."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return NodeAffinitySchedulingStrategy(self.ray.get_runtime_context().get_node_id(),
                                              soft=False)

    def leave(self) -> None:
        if self.is_joined_here and self.ray.is_initialized():
            self.ray.shutdown()


class RayActorHandle:
    """An actor running one long `run` call, with the members of a
    `multiprocessing.Process` the gateway reads: `pid`, `exitcode`, `is_alive()`, `join()`,
    `terminate()`, `kill()` and a `sentinel` file descriptor that turns readable when the
    call ends, which Ray makes happen when the actor dies (killed, crashed, node lost).
    `what` names it in log lines ("worker rank 1", "data-parallel engine 0").

    When `run` returns, the actor is ended too, so its process does not linger until its
    owner exits."""

    def __init__(self, ray: Any, actor: Any, what: str, run_ref: Any, pid: int,
                 host: str | None = None) -> None:
        self.ray, self.actor, self.what, self.pid, self.host = ray, actor, what, pid, host
        self.name = what
        self.exitcode: int | None = None
        self._is_stopped = False
        self._read, self._write = os.pipe()
        self.sentinel = self._read  # readable once `run` has ended (or the actor died)
        threading.Thread(target=self._watch, args=(run_ref,), daemon=True,
                         name=f"gateway-ray-{what.replace(' ', '-')}").start()

    @property
    def is_on_this_host(self) -> bool:
        return self.host == socket.gethostname()

    def _watch(self, run_ref: Any) -> None:
        try:
            result = self.ray.get(run_ref)
        except Exception as exc:  # RayActorError: killed, crashed, node lost
            if self._is_stopped:
                logger.info("Ray actor of %s (pid %s) stopped.", self.what, self.pid)
            else:
                logger.error("Ray actor of %s (pid %s) ended: %s", self.what, self.pid, exc)
            self.exitcode = 1
        else:
            self.exitcode = result if isinstance(result, int) else 0
            try:
                self.kill()
            except Exception:  # Ray is already shut down here: the actor went with it
                pass
        os.write(self._write, b"x")

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        wait([self.sentinel], timeout)

    def kill(self) -> None:
        self._is_stopped = True  # its end is no failure to report
        self.ray.kill(self.actor, no_restart=True)

    terminate = kill  # an actor has no gentler stop than its `run` returning


def forwarded_env() -> dict[str, str]:
    """The variables the actors need to find and allow the same plugins as this process."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_PREFIXES)}
    env.pop("GATEWAY_PROCESS_ROLE", None)  # each actor names itself
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env
