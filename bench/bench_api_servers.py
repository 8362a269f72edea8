"""Benchmark: the HTTP ceiling with 1 and 2 API servers (`--api-server-count`). Not a test.

Two real servers run at once, one with `--api-server-count 1` and one with 2 (the tiny random
model unless --model: these routes never reach the engine), each with the same endpoint
plugin. The same load (keep-alive HTTP/1.1 connections, split over several client processes
so that one client process is not the ceiling) is driven at /health and at the plugin
route of each, round by round interleaved, and requests/s and p50/p99 latency are printed
with the ratio 2 servers / 1 server.

More API servers only help where there are spare cores: each is one Python process with one
event loop. The core count is printed; on a machine with 2 cores shared with the load
client (and other work) the ratio may be below 1. Report it; do not tune to it.

    .venv/bin/python bench/bench_api_servers.py [--model PATH] [--rounds 4] [--seconds 2]
        [--concurrency 32] [--client-processes 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_http import PLUGIN_MODULE, PLUGIN_PATH, PLUGIN_SOURCE, Sample, load
from gateway.plugins import ENDPOINT_PLUGINS_GROUP
from tests.plugin_dists import subprocess_env, write_dist
from tests.server import ServerProcess

ROUTES = {"/health": "/health", "plugin route": PLUGIN_PATH}
COUNTS = (1, 2)


def cpu_summary() -> str:
    flags: set[str] = set()
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    shown = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{model}; {os.cpu_count()} cores ({usable} usable by this process); "
            f"flags: {', '.join(shown) or 'none of avx2/fma/avx512'}")


def _client(port: int, path: str, seconds: float, concurrency: int) -> Sample:
    return asyncio.run(load(port, path, seconds, concurrency))


def drive(pool: ProcessPoolExecutor, port: int, path: str, args: argparse.Namespace
          ) -> Sample:
    """`args.concurrency` connections over `args.client_processes` processes, for
    `args.seconds`; one Sample (requests summed, seconds of the slowest client)."""
    per_client = max(1, args.concurrency // args.client_processes)
    futures = [pool.submit(_client, port, path, args.seconds, per_client)
               for _ in range(args.client_processes)]
    total = Sample()
    for future in futures:
        sample = future.result()
        total.requests += sample.requests
        total.seconds = max(total.seconds, sample.seconds)
        total.latencies.extend(sample.latencies)
    return total


def tiny_model_folder() -> str:
    from tests.tiny_model import build_tiny_llama
    return str(build_tiny_llama(Path(tempfile.mkdtemp(prefix="bench-asc-model-"))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: a tiny random Llama")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--client-processes", type=int, default=2)
    args = parser.parse_args()

    site = Path(tempfile.mkdtemp(prefix="bench-asc-"))
    write_dist(site, "gateway-bench-endpoint",
               {ENDPOINT_PLUGINS_GROUP: {"bench_ping": f"{PLUGIN_MODULE}:make_plugin"}},
               {PLUGIN_MODULE: PLUGIN_SOURCE})
    env = subprocess_env(site, VLLM_PLUGINS="bench_ping")
    env.pop("VLLM_API_KEY", None)
    model = args.model or tiny_model_folder()
    servers = {count: ServerProcess(
        [model, "--kv-cache-memory", "64MiB", "--max-model-len", "512",
         "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
         "--api-server-count", str(count)], env=env,
        log_path=site / f"server-{count}.log") for count in COUNTS}
    print(f"CPU: {cpu_summary()}; dtype: float32 (the engine is idle: HTTP routes only)")
    try:
        for server in servers.values():
            server.start()
        totals = {(route, count): Sample() for route in ROUTES for count in COUNTS}
        with ProcessPoolExecutor(args.client_processes) as pool:
            for path in ROUTES.values():  # warm-up, not counted
                for server in servers.values():
                    drive(pool, server.port, path, argparse.Namespace(**{**vars(args),
                                                                         "seconds": 0.5}))
            for _ in range(args.rounds):
                for route, path in ROUTES.items():
                    for count, server in servers.items():
                        totals[(route, count)].add(drive(pool, server.port, path, args))
        report(totals, args)
    finally:
        codes = {count: server.stop() for count, server in servers.items()}
        print(f"stopped with SIGTERM: exit codes {codes}; processes left behind: "
              f"{sum(len(s.leftover_pids) for s in servers.values())}")


def report(totals: dict[tuple[str, int], Sample], args: argparse.Namespace) -> None:
    print(f"\n{args.rounds} interleaved rounds of {args.seconds} s per target, "
          f"{args.concurrency} keep-alive connections from {args.client_processes} client "
          "processes")
    print(f"{'route':<14}{'API servers':>12}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}")
    for (route, count), sample in totals.items():
        print(f"{route:<14}{count:>12}{sample.rps:>9.0f}{sample.percentile_ms(0.50):>9.2f}"
              f"{sample.percentile_ms(0.99):>9.2f}")
    for route in ROUTES:
        ratio = totals[(route, 2)].rps / max(totals[(route, 1)].rps, 1e-9)
        print(f"{route}: 2 API servers / 1 = {ratio:.2f}x")


if __name__ == "__main__":
    main()
