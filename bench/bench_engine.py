"""Benchmark: output tokens/s through the engine client (process boundary, ZMQ, scheduler,
detokenizer) against the same worker driven directly in one process, same run.

Not a test. Default model, greedy, 128 prompt tokens and 128 generated (EOS ignored), at
1, 8 and 32 concurrent requests. The direct side is bench_worker.py's driver: the worker
called in this process with a minimal scheduler and no detokenization. Target: at 32
concurrent, the engine client reaches at least 0.90x the direct throughput.

    .venv/bin/python bench/bench_engine.py [--dtype bfloat16] [--concurrency 1,8,32]
        [--prompt-len 128] [--gen-len 128]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_worker import Driver, make_prompts  # noqa: E402
from gateway.config import CacheConfig, EngineConfig, ModelConfig  # noqa: E402
from gateway.frontend.engine_client.client import AsyncEngineClient  # noqa: E402
from gateway.sampling_params import SamplingParams  # noqa: E402


async def bench_client(client: AsyncEngineClient, prompts: list[list[int]], gen_len: int) -> float:
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=gen_len)

    async def one(i: int, prompt: list[int]) -> int:
        count = 0
        async for out in client.generate(prompt, params, f"bench-{time.monotonic()}-{i}"):
            count = len(out.token_ids)
        return count

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - start
    assert all(c == gen_len for c in counts), counts
    return sum(counts) / elapsed


def bench_direct(driver: Driver, prompts: list[list[int]], gen_len: int) -> float:
    start = time.perf_counter()
    driver.generate(prompts, gen_len)
    return len(prompts) * gen_len / (time.perf_counter() - start)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--kv-cache-memory", type=float, default=0.5)
    args = parser.parse_args()
    config = EngineConfig(model=ModelConfig(dtype=args.dtype),
                          cache=CacheConfig(kv_cache_memory_gib=args.kv_cache_memory))
    from gateway.worker.worker import Worker
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    driver = Driver(worker, worker.initialize_kv_cache())
    client = await AsyncEngineClient.start(config)
    try:
        # Warm both sides once.
        warm = make_prompts(2, 16, client.vocab_size, seed=0)
        bench_direct(driver, warm, 4)
        await bench_client(client, warm, 4)
        print(f"{'concurrent':>10} {'direct tok/s':>13} {'client tok/s':>13} {'ratio':>6}")
        for n in [int(c) for c in args.concurrency.split(",")]:
            prompts = make_prompts(n, args.prompt_len, client.vocab_size, seed=n)
            direct = bench_direct(driver, prompts, args.gen_len)
            through = await bench_client(client, prompts, args.gen_len)
            print(f"{n:>10} {direct:>13.1f} {through:>13.1f} {through / direct:>6.2f}")
        print("ratio = engine client / direct worker (target at 32 concurrent: >= 0.90)")
    finally:
        await client.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
