"""The Ray cluster, as every process of the gateway that places actors sees it (any process).

Two places put work on Ray: the engine core places its tensor-parallel ranks
(`--distributed-executor-backend ray`, executor/ray.py), and the front end places the
data-parallel engine cores (`--data-parallel-backend ray`,
frontend/engine_client/ray_engines.py). Both join the cluster here, the same way, and watch
their actors through the same handle. The actors get this process's PYTHONPATH and its
VLLM_*, GATEWAY_* and HF_* variables, so plugins are found and allowed there as here.
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
LOOPBACK = "127.0.0.1"
# Ray's own switch (meant for macOS and Windows): "0" keeps every node address on loopback.
_RAY_LOOPBACK_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def has_ray_token() -> bool:
    """Whether a Ray authentication token is at hand, where Ray looks for one: RAY_AUTH_TOKEN,
    the file RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(
        os.path.expanduser("~"), ".ray", "auth_token")
    return os.path.isfile(path)


def is_loopback_cluster(address: str | None) -> bool:
    """Whether RAY_ADDRESS `address` means a cluster on this machine's loopback: unset or
    `local` (a cluster the gateway starts) or a loopback host. `auto`, a real address and
    `ray://` client addresses are the operator's cluster, joined as Ray itself would."""
    if not address or address == "local":
        return True
    if "://" in address:
        return False
    host = address.rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


class RayCluster:
    """This process's connection to the Ray cluster; `leave()` ends it only when `join()`
    made it (an actor leaves its worker's connection alone)."""

    def __init__(self, ray: Any, is_joined_here: bool) -> None:
        self.ray = ray
        self.is_joined_here = is_joined_here

    @classmethod
    def join(cls) -> RayCluster:
        """Connect to the cluster that RAY_ADDRESS names (`ray start --head` and its address,
        or an existing cluster), or start a local one when none is named. A local cluster, or
        one named by a loopback address, stays on 127.0.0.1 (driver, head and actors bind and
        connect there and nowhere else). Inside a Ray actor (an engine core that is itself an
        actor) Ray is connected already and that connection is used.
        """
        # Ray folds identical lines of several actors into one ("[repeated 2x across
        # cluster]"), so one rank's plugin and load lines would hide another's: every
        # actor's lines reach the log as they are unless the operator chose otherwise.
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        on_loopback = is_loopback_cluster(os.environ.get("RAY_ADDRESS"))
        if on_loopback:
            # Ray turns a loopback address (the driver's bootstrap address, a node's
            # address, ours) into this machine's interface address, where a head started
            # on 127.0.0.1 may not listen, unless "clusters" are off: then every node
            # address is 127.0.0.1. Read when Ray is imported, so set before.
            os.environ.setdefault(_RAY_LOOPBACK_VARIABLE, "0")
        if os.environ.get("RAY_ADDRESS") not in (None, "", "local") and has_ray_token():
            # As `ray start` does for a head: a token at hand means token authentication.
            # A driver connecting to an existing cluster otherwise sends none, and a head
            # started with a token refuses it; a head without one ignores it.
            os.environ.setdefault("RAY_AUTH_MODE", "token")
        import ray

        if ray.is_initialized():
            return cls(ray, is_joined_here=False)
        options: dict[str, Any] = {}
        if os.environ.get("RAY_ADDRESS") in (None, "", "local"):  # ours needs no dashboard
            options["include_dashboard"] = False
        if on_loopback:
            options["_node_ip_address"] = LOOPBACK
        ray.init(runtime_env={"env_vars": forwarded_env()}, **options)
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
