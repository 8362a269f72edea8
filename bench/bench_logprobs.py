"""What logprobs cost: throughput at C concurrent completions (default 32) with none asking
for logprobs, against half of them asking (`logprobs: 5`), in one run. Not a test.

One real server (the default model unless --model), then rounds alternating between the
two loads (none, half, none, half, ...) so that a machine whose speed drifts affects both
alike. Prints generated tokens/s of each load, their ratio, the CPU flags and the dtype.

    .venv/bin/python bench/bench_logprobs.py [--model PATH] [--concurrency 32]
        [--rounds 3] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.server import ServerProcess

PROMPTS = ["The quick brown fox", "Once upon a time", "Hello, world! This is",
           "Summarize the following text:"]


async def one_round(url: str, concurrency: int, max_tokens: int, with_logprobs: bool
                    ) -> float:
    """Generated tokens per second of `concurrency` requests sent at once."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(i: int) -> int:
            body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                    "temperature": 0.0, "ignore_eos": True}
            if with_logprobs and i % 2 == 0:
                body["logprobs"] = 5
            response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            data = response.json()
            assert (data["choices"][0]["logprobs"] is not None) == ("logprobs" in body)
            return int(data["usage"]["completion_tokens"])
        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(concurrency)))
        return sum(tokens) / (time.perf_counter() - started)


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return platform.processor() or "unknown"
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
    return " ".join(f for f in wanted if f in flags) or "none of avx2/fma/avx512"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    flags = ["--max-num-seqs", str(args.concurrency), "--dtype", args.dtype,
             "--disable-uvicorn-access-log", "--kv-cache-memory", "512MiB"]
    model = [args.model] if args.model else []
    with tempfile.TemporaryDirectory(prefix="bench-logprobs-") as tmp, \
            ServerProcess([*model, *flags], log_path=Path(tmp) / "server.log") as server:
        url = server.url()
        asyncio.run(one_round(url, args.concurrency, 4, True))  # warm-up
        results: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for with_logprobs in (False, True):
                results[with_logprobs].append(asyncio.run(one_round(
                    url, args.concurrency, args.max_tokens, with_logprobs)))
    none, half = statistics.median(results[False]), statistics.median(results[True])
    print(f"model: {args.model or 'default (SmolLM2-135M-Instruct)'}, dtype {args.dtype}, "
          f"CPU flags: {cpu_flags()}")
    print(f"concurrency {args.concurrency}, {args.max_tokens} tokens each, "
          f"{args.rounds} rounds per load (medians)")
    print(f"no logprobs:            {none:8.1f} tokens/s  (rounds: "
          f"{', '.join(f'{v:.1f}' for v in results[False])})")
    print(f"half with logprobs=5:   {half:8.1f} tokens/s  (rounds: "
          f"{', '.join(f'{v:.1f}' for v in results[True])})")
    print(f"ratio half/none: {half / none:.3f} (cost {100 * (1 - half / none):.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
