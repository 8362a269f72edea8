"""Benchmark: generation throughput with --data-parallel-size 1 against 2 (or --sizes), at
the same total compute threads, through the real server. Not a test.

Each size is one `gateway serve` of the default model (unless --model): DP=1 is one engine
whose worker takes every allowed core; DP=N is N engines whose workers split the cores
between them (one thread each on 2 cores: the worker's thread plan counts every engine's
workers). `--clients` concurrent streaming clients each send `--per-client` greedy
requests of `--max-tokens` tokens (EOS ignored, distinct prompts); the figure is output
tokens/s over the phase, with the time to first token p50 and how the requests were spread
over the engines (read from /metrics, `vllm:request_success_total` by `engine`).

Sizes run back to back, `--rounds` times interleaved, and each figure is printed as a ratio
to the first size's, so that a shared machine compares like with like. On a machine with
few cores DP may well lose: N copies of the model share the caches and memory bandwidth,
each engine core's Python competes with the front end, and a batch split in N runs N
smaller matmuls. The benchmark reports; it does not tune.

    .venv/bin/python bench/bench_data_parallel.py [--sizes 1,2] [--clients 16]
        [--per-client 2] [--max-tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_decode import SERVED, Result, cpu_flags, many_clients  # noqa: E402
from tests.server import ServerProcess  # noqa: E402


def requests_by_engine(url: str) -> dict[str, float]:
    """{engine label: finished requests} from the server's /metrics."""
    counts: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = re.search(r'engine="(\d+)"', line)
            if engine:
                counts[engine.group(1)] = counts.get(engine.group(1), 0.0) + float(
                    line.rsplit(" ", 1)[1])
    return counts


def measure(size: int, args: argparse.Namespace, result: Result, seed: int) -> str:
    """One round of one size; returns its spread over the engines and its worker lines."""
    serve_args = ([args.model] if args.model else []) + [
        "--data-parallel-size", str(size), "--kv-cache-memory", "512MiB",
        "--served-model-name", SERVED, "--dtype", args.dtype,
        "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    server = ServerProcess(serve_args).start()
    try:
        asyncio.run(many_clients(server.url(), args, result, seed))
        spread = requests_by_engine(server.url())
        workers = sorted(set(re.findall(r"\d+ threads?, [^\n]*", server.log_text())))
    finally:
        server.stop()
    return f"requests by engine {spread}; workers: {workers}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2")
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=60)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--per-client", type=int, default=2)
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    results = {size: Result() for size in sizes}
    notes: dict[int, str] = {}
    for round_index in range(args.rounds):
        for size in sizes:
            print(f"round {round_index + 1}: DP={size} ...", flush=True)
            notes[size] = measure(size, args, results[size], seed=round_index)
    print(f"\nCPU: {cpu_flags()}")
    print(f"dtype asked: {args.dtype}; load average now: {os.getloadavg()[0]:.1f} "
          "(a shared machine: compare the ratios)")
    base = results[sizes[0]]
    print(f"\n{'size':<8}{'tok/s':>9}{'x first':>9}{'TTFT p50 s':>12}{'failed':>8}")
    for size in sizes:
        result = results[size]
        print(f"DP={size:<5}{result.tokens_per_s():>9.1f}"
              f"{result.tokens_per_s() / base.tokens_per_s():>9.2f}"
              f"{result.ttft_p50_s():>12.2f}{result.failed:>8}")
    for size in sizes:
        print(f"  DP={size}: {notes[size]}")
    print(f"({args.clients} clients x {args.per_client} requests x {args.max_tokens} tokens "
          f"per round; {args.rounds} round(s))")


if __name__ == "__main__":
    main()
