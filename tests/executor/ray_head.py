"""A real local Ray cluster for the executor tests (`ray start --head` on loopback), one for
the tests/executor package (`ray_address` in conftest.py): the Ray executor's tests and the
data-parallel engine actors' tests share it, so it starts once.

The cluster's agents get fixed ports: on a loaded machine the raylet otherwise gives up
waiting for the dashboard agent to report the ports it picked.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.executor.test_tensor_parallel_server import _alive_after
from tests.server import free_port


def cluster_pids(temp_dir: Path) -> set[int]:
    """The processes of the cluster whose session lives under `temp_dir` (ours alone): named
    in their command line, or, for the agents that rename themselves (`ray::DashboardAgent`,
    `ray::RuntimeEnvAgent`) and outlive the raylet, holding a file open there. Never this
    process (a driver holds its session's log files open too)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if (str(temp_dir).encode() in (entry / "cmdline").read_bytes()
                        or _holds_file_under(entry, str(temp_dir))):
                    pids.add(int(entry.name))
            except OSError:
                pass
    return pids


def _holds_file_under(entry: Path, folder: str) -> bool:
    for fd in (entry / "fd").iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(fd).startswith(folder):
                return True
    return False


def start_head(temp_dir: Path, attempts: int = 3) -> str:
    """`ray start --head` on loopback. Tried again when the raylet gave up waiting for its
    dashboard agent (a fixed 15 s in Ray; a busy 2-core machine can miss it once, and the
    next try finds the agent's imports in the page cache)."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           # every node address 127.0.0.1, as the gateway's own clusters (ray_cluster.py)
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "GATEWAY_CPU_LONE_DECODE": "0",  # see ONE_PATH in conftest.py
           # The control service declares the node dead after 5 missed health checks
           # (3 s apart, 10 s each) by default: a 2-core machine busy with a server, its
           # engines and the test's clients once missed them (CI). This one is never
           # lost for real, so it may be slow for a few minutes instead.
           "RAY_health_check_failure_threshold": "60"}
    ray = Path(sys.executable).with_name("ray")
    output = ""
    for _ in range(attempts):
        port, *agent_ports = (free_port() for _ in range(5))
        started = subprocess.run(
            [str(ray), "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
             "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats",
             "--temp-dir", str(temp_dir), "--metrics-export-port", str(agent_ports[0]),
             "--dashboard-agent-grpc-port", str(agent_ports[1]),
             "--dashboard-agent-listen-port", str(agent_ports[2]),
             "--runtime-env-agent-port", str(agent_ports[3])],
            env=env, capture_output=True, text=True, timeout=300, check=False)
        if started.returncode == 0:
            return f"127.0.0.1:{port}"
        output = started.stdout + started.stderr + _raylet_errors(temp_dir)
        stop_cluster(temp_dir)
    raise AssertionError(f"ray start --head failed {attempts} times; the last:\n{output}")


def stop_cluster(temp_dir: Path) -> None:
    """End the cluster's processes (found by their session folder, so only ours). The agents
    do not stop on SIGTERM: a short wait for the others, then SIGKILL for what is left."""
    for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
        for pid in cluster_pids(temp_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        _alive_after(cluster_pids(temp_dir), wait_s)


def _raylet_errors(temp_dir: Path) -> str:
    return "".join(path.read_text(errors="replace")[:2000]
                   for path in temp_dir.glob("session_*/logs/raylet.err"))
