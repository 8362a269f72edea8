"""Benchmark: decode speed through the real server, as a streaming client sees it. Not a test.

Each variant is one `gateway serve` (the default model unless --model), measured by a real
streaming HTTP client (httpx, SSE) in two phases:
1. one client: `--requests` greedy completions one after another, `--max-tokens` tokens each
   (EOS ignored); the inter-token latency is the gap between successive SSE events, p50.
2. `--clients` concurrent clients, each sending `--per-client` such requests (distinct
   prompts): output tokens/s over the phase, time to first token p50, failed requests.

Variants run back to back, `--rounds` times interleaved, and every figure is also printed
as a ratio to the first variant's, so a noisy shared machine still compares like with like.
A variant is `LABEL[@GITREF][:KEY=VALUE,...]`: `@GITREF` serves that commit's `gateway/`
(extracted with `git archive` into a temporary folder), the KEY=VALUEs are environment
variables of the server (e.g. VLLM_CPU_NUM_OF_RESERVED_CPU=0), or its flags where KEY starts
with `--` (e.g. --quantization=gguf; a flag without a value: --async-scheduling).
`--async-compare` runs three variants: `main` (the main branch, before the async scheduling
work), `sync` (this tree, flag off) and `async` (this tree, --async-scheduling). `--env`
sets server variables of every variant: OMP_WAIT_POLICY=passive (no short spin in any
variant) takes libgomp's spin throttling out of the comparison (docs/cpu-performance.md).

    .venv/bin/python bench/bench_decode.py                                # this tree alone
    .venv/bin/python bench/bench_decode.py --variant now --variant before@main
    .venv/bin/python bench/bench_decode.py --variant default \\
        --variant reserve1:VLLM_CPU_NUM_OF_RESERVED_CPU=1 --clients 0
    .venv/bin/python bench/bench_decode.py --variant q4:--quantization=gguf \
        --variant q4-int4:--quantization=gguf,GATEWAY_CPU_QUANT_KERNELS=0
    .venv/bin/python bench/bench_decode.py --async-compare --env OMP_WAIT_POLICY=passive
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.server import ServerProcess, descendant_pids  # noqa: E402

SERVED = "bench"
_WORDS = ("river stone market quiet engine yellow garden winter number letter window "
          "little music paper travel summer friend silver forest story bridge morning").split()
_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


@dataclass
class Variant:
    label: str
    ref: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, spec: str) -> Variant:
        head, _, assignments = spec.partition(":")
        label, _, ref = head.partition("@")
        pairs = [item.split("=", 1) for item in assignments.split(",") if item]
        env = {pair[0]: pair[1] for pair in pairs if not pair[0].startswith("--")}
        flags = [part for pair in pairs if pair[0].startswith("--") for part in pair]
        return cls(label, ref or None, env, flags)


@dataclass
class Result:
    gaps: list[float] = field(default_factory=list)  # one client: seconds between events
    many_gaps: list[float] = field(default_factory=list)  # many clients: the same
    one_client_seconds: float = 0.0  # streaming its measured requests
    ttfts: list[float] = field(default_factory=list)  # many clients
    output_tokens: int = 0
    seconds: float = 0.0
    failed: int = 0
    rss_growth: list[float] = field(default_factory=list)
    worker_line: str = ""
    # one client: CPU seconds used by each process, and the tokens they streamed
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    streamed_tokens: int = 0

    def itl_p50_ms(self) -> float:
        return 1000 * statistics.median(self.gaps) if self.gaps else float("nan")

    def many_itl_p50_ms(self) -> float:
        return 1000 * statistics.median(self.many_gaps) if self.many_gaps else float("nan")

    def one_client_tokens_per_s(self) -> float:
        return (self.streamed_tokens / self.one_client_seconds if self.one_client_seconds
                else float("nan"))

    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else float("nan")

    def ttft_p50_s(self) -> float:
        return statistics.median(self.ttfts) if self.ttfts else float("nan")


# ------------------------------------------------------------------ the client
def prompt(seed: int, num_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


async def stream_one(client: httpx.AsyncClient, text: str, max_tokens: int,
                     ) -> tuple[float, list[float], int]:
    """(time to first token, the times of every event after it, tokens) of one stream. The
    tokens are the usage's count: a token that ends in the middle of a character is sent
    with the next one, so a stream can have fewer events than tokens."""
    body = {"model": SERVED, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if event["choices"]:
                    times.append(time.perf_counter())
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    if tokens < max_tokens or not times:
        raise RuntimeError(f"{tokens} tokens in {len(times)} events for {max_tokens} tokens")
    return times[0] - start, times, tokens


async def one_client(url: str, args: argparse.Namespace, result: Result) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await stream_one(client, prompt(0, args.prompt_words), 8)  # warm-up
        for i in range(args.requests):
            start = time.perf_counter()
            _, times, tokens = await stream_one(client, prompt(1000 + i, args.prompt_words),
                                                args.max_tokens)
            result.one_client_seconds += time.perf_counter() - start
            result.gaps += [b - a for a, b in zip(times, times[1:])]
            result.streamed_tokens += tokens


async def many_clients(url: str, args: argparse.Namespace, result: Result, seed: int) -> None:
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def client_loop(index: int) -> None:
            for j in range(args.per_client):
                text = prompt(seed * 100_000 + index * 100 + j, args.prompt_words)
                try:
                    ttft, times, tokens = await stream_one(client, text, args.max_tokens)
                except (httpx.HTTPError, RuntimeError, KeyError, ValueError):
                    result.failed += 1
                    continue
                result.ttfts.append(ttft)
                result.many_gaps += [b - a for a, b in zip(times, times[1:])]
                result.output_tokens += tokens

        start = time.perf_counter()
        await asyncio.gather(*(client_loop(i) for i in range(args.clients)))
        result.seconds += time.perf_counter() - start


# ------------------------------------------------------------------ the servers
@contextlib.contextmanager
def source_tree(ref: str | None) -> Iterator[Path]:
    """This checkout, or `ref`'s gateway/ extracted into a temporary folder."""
    if ref is None:
        yield REPO
        return
    with tempfile.TemporaryDirectory(prefix="bench-decode-src-") as tmp:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "gateway"],
                                 check=True, capture_output=True).stdout
        archive_path = Path(tmp) / "src.tar"
        archive_path.write_bytes(archive)
        with tarfile.open(archive_path) as tar:
            tar.extractall(tmp, filter="data")
        yield Path(tmp)


def rss_bytes(pid: int) -> int:
    total = 0
    for each in {pid, *descendant_pids(pid)}:
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{each}/status").read_text()
            total += int(status.split("VmRSS:")[1].split()[0]) * 1024
    return total


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the front end (`pid`), the processes it
    started (engine core, workers) and this one (the client)."""
    ticks = os.sysconf("SC_CLK_TCK")

    def of(each: int) -> float:
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{each}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            return (int(fields[11]) + int(fields[12])) / ticks
        return 0.0

    own = os.times()
    return {"front end": of(pid), "engine+workers": sum(of(p) for p in descendant_pids(pid)),
            "client": own.user + own.system}


def measure(variant: Variant, args: argparse.Namespace, result: Result, seed: int) -> None:
    serve_args = ([args.model] if args.model else []) + [
        "--kv-cache-memory", "1GiB", "--served-model-name", SERVED, "--dtype", args.dtype,
        "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", *variant.flags]
    with source_tree(variant.ref) as tree:
        env = {**os.environ, **variant.env}
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")])
        cwd = os.getcwd()
        os.chdir(tree)  # `python -m` puts the working directory first on sys.path
        try:
            server = ServerProcess(serve_args, env=env).start()
        finally:
            os.chdir(cwd)
        try:
            match = re.search(r"Worker 0: .*", server.log_text())
            result.worker_line = match.group(0) if match else "?"
            if args.requests:
                assert server.process is not None
                before = cpu_seconds(server.process.pid)
                asyncio.run(one_client(server.url(), args, result))
                for name, seconds in cpu_seconds(server.process.pid).items():
                    result.cpu_seconds[name] = (result.cpu_seconds.get(name, 0.0) + seconds
                                                - before.get(name, 0.0))
            if args.clients:
                assert server.process is not None
                rss_before = rss_bytes(server.process.pid)
                asyncio.run(many_clients(server.url(), args, result, seed))
                result.rss_growth.append(rss_bytes(server.process.pid) / rss_before - 1)
        finally:
            server.stop()


# ------------------------------------------------------------------ the report
def cpu_flags() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines()
                      if line.startswith("flags")), []))
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                  if line.startswith("model name")), "?")
    shown = " ".join(f"{flag}={'yes' if flag in flags else 'no'}" for flag in _CPU_FLAGS)
    return f"{model}, {len(os.sched_getaffinity(0))} cores allowed; {shown}"


def report(variants: list[Variant], results: list[Result], args: argparse.Namespace) -> None:
    print(f"\nCPU: {cpu_flags()}")
    print(f"dtype asked: {args.dtype}; load average now: {os.getloadavg()[0]:.1f}")
    for variant, result in zip(variants, results):
        print(f"  {variant.label}: {result.worker_line}")
    base = results[0]
    print(f"\n{'variant':<16}{'ITL p50 ms':>12}{'x first':>9}{'tok/s':>9}{'x first':>9}"
          f"{'TTFT p50 s':>12}{'failed':>8}{'RSS growth':>12}")
    for variant, result in zip(variants, results):
        growth = max(result.rss_growth) if result.rss_growth else float("nan")
        print(f"{variant.label:<16}{result.itl_p50_ms():>12.1f}"
              f"{result.itl_p50_ms() / base.itl_p50_ms():>9.2f}{result.tokens_per_s():>9.1f}"
              f"{result.tokens_per_s() / base.tokens_per_s():>9.2f}"
              f"{result.ttft_p50_s():>12.2f}{result.failed:>8}{growth:>+12.1%}")
    print(f"\n{'variant':<16}{'1 client: ITL p50 ms':>22}{'tok/s':>8}"
          f"{f'{args.clients} clients: ITL p50 ms':>26}{'tok/s':>8}")
    for variant, result in zip(variants, results):
        print(f"{variant.label:<16}{result.itl_p50_ms():>22.1f}"
              f"{result.one_client_tokens_per_s():>8.1f}"
              f"{result.many_itl_p50_ms():>26.1f}{result.tokens_per_s():>8.1f}")
    print("\nOne client, CPU per streamed token (ms), by process:")
    for variant, result in zip(variants, results):
        tokens = max(1, result.streamed_tokens)
        print(f"  {variant.label:<14}" + "  ".join(
            f"{name} {1000 * seconds / tokens:.1f}"
            for name, seconds in result.cpu_seconds.items()))
    print(f"(1 client: {args.requests} x {args.max_tokens} tokens per round; "
          f"{args.clients} clients x {args.per_client} requests; {args.rounds} round(s))")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", default=None,
                        help="LABEL[@GITREF][:KEY=VALUE,...] (repeatable; default: 'now')")
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--requests", type=int, default=3, help="one-client requests")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=100)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--per-client", type=int, default=2)
    parser.add_argument("--async-compare", action="store_true",
                        help="variants main@main, sync and async:--async-scheduling")
    parser.add_argument("--env", default="", metavar="KEY=VALUE,...",
                        help="server environment of every variant (e.g. OMP_WAIT_POLICY=passive)")
    args = parser.parse_args()
    specs = args.variant or ["now"]
    if args.async_compare:
        specs = ["main@main", "sync", "async:--async-scheduling"]
    variants = [Variant.parse(spec) for spec in specs]
    for variant in variants:
        variant.env = {**Variant.parse(f"all:{args.env}").env, **variant.env}
    results = [Result() for _ in variants]
    for round_index in range(args.rounds):
        for variant, result in zip(variants, results):
            print(f"round {round_index + 1}: {variant.label} ...", flush=True)
            measure(variant, args, result, seed=round_index)
    report(variants, results, args)


if __name__ == "__main__":
    main()
