"""Benchmark: the HTTP front end against a bare FastAPI app, start-up time and memory, and
the per-token cost of streaming. Not a test.

1. Start-up: seconds from `gateway serve` (default model unless --model, 1 GiB KV budget)
   to GET /health answering 200, and the resident memory (RSS, summed over the server and
   every process it started) at that moment. Targets: < 15 s and < 2 GiB.
2. Throughput: requests/s and p50/p99 latency of a plugin route and of /health on the
   gateway, against a bare FastAPI app serving the same handlers under the same uvicorn
   settings (no access log), driven by the same load client (raw keep-alive HTTP/1.1 over
   asyncio, so the client is not the bottleneck), interleaved round by round. Target: the
   plugin route at >= 0.90x the bare app's requests/s.
3. Streaming: the same greedy request (EOS ignored) streamed as SSE and answered whole,
   interleaved; the difference per token is what streaming costs.

    .venv/bin/python bench/bench_http.py [--model PATH] [--rounds 5] [--seconds 2]
        [--concurrency 16] [--stream-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.plugins import ENDPOINT_PLUGINS_GROUP
from tests.plugin_dists import subprocess_env, write_dist
from tests.server import ServerProcess, descendant_pids, free_port

PLUGIN_PATH = "/v1/bench-ping"
PLUGIN_MODULE = "gateway_bench_endpoint"
PLUGIN_SOURCE = '''
from fastapi import APIRouter, FastAPI
from starlette.responses import Response


async def bench_ping():
    return {"ok": True}


async def health():
    return Response(status_code=200)


class BenchPlugin:
    name, required_tasks = "bench_ping", None

    def attach_router(self, app):
        router = APIRouter()
        router.add_api_route("/v1/bench-ping", bench_ping, methods=["GET"])
        app.include_router(router)

    async def init_state(self, engine_client, state, args):
        pass


def make_plugin():
    return BenchPlugin()


def bare_app():
    """A bare FastAPI app with the same handlers, in the gateway's order: /health (a core
    route) first, then the plugin's route."""
    app = FastAPI()
    app.add_api_route("/health", health, methods=["GET"])
    BenchPlugin().attach_router(app)
    return app
'''


# ------------------------------------------------------------------ load client
@dataclass
class Sample:
    requests: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)

    def add(self, other: Sample) -> None:
        self.requests += other.requests
        self.seconds += other.seconds
        self.latencies.extend(other.latencies)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile_ms(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _connection(port: int, path: str, deadline: float, sample: Sample) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    try:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"{path}: {head.splitlines()[0]!r}")
            length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await reader.readexactly(length)
            sample.latencies.append(time.perf_counter() - start)
            sample.requests += 1
    finally:
        writer.close()


async def load(port: int, path: str, seconds: float, concurrency: int) -> Sample:
    """Keep `concurrency` keep-alive connections busy on `path` for `seconds`."""
    sample = Sample()
    start = time.perf_counter()
    deadline = start + seconds
    await asyncio.gather(*(_connection(port, path, deadline, sample)
                           for _ in range(concurrency)))
    sample.seconds = time.perf_counter() - start
    return sample


# ------------------------------------------------------------------ processes
def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and every process below it (summed VmRSS)."""
    total = 0
    for each in {pid, *descendant_pids(pid)}:
        try:
            for line in Path(f"/proc/{each}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def start_bare_app(site: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", f"{PLUGIN_MODULE}:bare_app",
         "--host", "127.0.0.1", "--port", str(port), "--no-access-log",
         "--log-level", "warning"], env=subprocess_env(site))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process, port
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise TimeoutError("the bare app did not start")


# ------------------------------------------------------------------ the three benchmarks
def report_startup(server: ServerProcess) -> None:
    assert server.process is not None and server.ready_after_s is not None
    rss = rss_bytes(server.process.pid)
    print(f"start-up: /health 200 after {server.ready_after_s:.1f} s (target < 15 s); "
          f"RSS of the process tree at ready {rss / 2**30:.2f} GiB (target < 2 GiB)")


def compare_throughput(gateway_port: int, bare_port: int, args: argparse.Namespace) -> None:
    targets = {("plugin route", "gateway"): (gateway_port, PLUGIN_PATH),
               ("plugin route", "bare"): (bare_port, PLUGIN_PATH),
               ("/health", "gateway"): (gateway_port, "/health"),
               ("/health", "bare"): (bare_port, "/health")}
    totals = {key: Sample() for key in targets}
    for port, path in targets.values():  # warm-up, not counted
        asyncio.run(load(port, path, 0.5, args.concurrency))
    for _ in range(args.rounds):
        for key, (port, path) in targets.items():
            totals[key].add(asyncio.run(load(port, path, args.seconds, args.concurrency)))
    print(f"\nthroughput: {args.rounds} interleaved rounds of {args.seconds} s per target, "
          f"{args.concurrency} keep-alive connections")
    print(f"{'route':<14}{'app':<9}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}")
    for (route, app), sample in totals.items():
        print(f"{route:<14}{app:<9}{sample.rps:>9.0f}{sample.percentile_ms(0.50):>9.2f}"
              f"{sample.percentile_ms(0.99):>9.2f}")
    for route in ("plugin route", "/health"):
        ratio = totals[(route, "gateway")].rps / totals[(route, "bare")].rps
        target = " (target >= 0.90)" if route == "plugin route" else ""
        print(f"{route}: gateway / bare = {ratio:.2f}x{target}")


def streaming_overhead(port: int, model: str, num_tokens: int, repeats: int = 3) -> None:
    """Per-token cost of SSE: the same greedy request streamed and whole, interleaved."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": num_tokens,
            "temperature": 0, "ignore_eos": True}
    whole, streamed = [], []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        client.post("/v1/completions", json=body)  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            client.post("/v1/completions", json=body).raise_for_status()
            whole.append(time.perf_counter() - start)
            start = time.perf_counter()
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                events = sum(1 for line in r.iter_lines() if line.startswith("data: "))
            streamed.append(time.perf_counter() - start)
    per_token_ms = 1000 * (statistics.median(streamed) - statistics.median(whole)) / num_tokens
    print(f"\nstreaming: {num_tokens} tokens, whole {statistics.median(whole):.3f} s, "
          f"streamed {statistics.median(streamed):.3f} s ({events} events): "
          f"{per_token_ms:+.3f} ms per token for SSE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--stream-tokens", type=int, default=64)
    args = parser.parse_args()

    site = Path(tempfile.mkdtemp(prefix="bench-http-"))
    write_dist(site, "gateway-bench-endpoint",
               {ENDPOINT_PLUGINS_GROUP: {"bench_ping": f"{PLUGIN_MODULE}:make_plugin"}},
               {PLUGIN_MODULE: PLUGIN_SOURCE})
    env = subprocess_env(site, VLLM_PLUGINS="bench_ping")
    env.pop("VLLM_API_KEY", None)
    serve_args = ([args.model] if args.model else []) + [
        "--kv-cache-memory", "1GiB", "--served-model-name", "bench",
        "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    server = ServerProcess(serve_args, env=env, log_path=site / "server.log")
    bare = None
    try:
        server.start()
        report_startup(server)
        bare, bare_port = start_bare_app(site)
        compare_throughput(server.port, bare_port, args)
        streaming_overhead(server.port, "bench", args.stream_tokens)
    finally:
        if bare is not None:
            bare.terminate()
            bare.wait()
        server.stop()
        print(f"\n(server log: {server.log_path}; pid {os.getpid()})")


if __name__ == "__main__":
    main()
