"""What the stats cost: generation throughput with stats on and off, in the same run.

Not a test. Two engines serve the same model side by side: one collects iteration stats in
the engine core and feeds the stat-logger manager (built-in logging and Prometheus loggers
plus any installed plugin loggers, the periodic log task running), the other collects
nothing and has no stat loggers. Rounds alternate between them (on, off, off, on, ...) so
drift in the machine's speed falls on both; each round sends the same concurrent greedy
requests (EOS ignored) and measures output tokens per second; the cost is the median of
the paired (adjacent on/off) ratios.

End to end, the noise of a shared machine is larger than the cost, so the cost is also
measured part by part, each against the real step time of the stats-on engine: the engine
core's collector (the scheduler stepping the same batch without a model, stats on and off),
the extra bytes on the socket (encoding and decoding a step's outputs with and without
stats), and the time inside the front end's stat loggers (timed around each call).

    .venv/bin/python bench/bench_stats.py                    # default model, ~3 minutes
    .venv/bin/python bench/bench_stats.py --quick            # a short smoke run
    .venv/bin/python bench/bench_stats.py --model PATH --requests 32 --max-tokens 64

Target: the stats cost under 3% of throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from gateway.engine.kv_cache_manager import KVCacheManager  # noqa: E402
from gateway.engine.request import Request  # noqa: E402
from gateway.engine.scheduler import Scheduler  # noqa: E402
from gateway.frontend.engine_client.client import AsyncEngineClient  # noqa: E402
from gateway.messages import (  # noqa: E402
    EngineCoreOutputs,
    EngineCoreRequest,
    ModelRunnerOutput,
)
from gateway.metrics import StatLoggerManager  # noqa: E402
from gateway.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["Summarize the following text in one sentence.", "Once upon a time there was",
           "The quick brown fox jumps over the lazy dog.", "Write a haiku about servers."]


class TimedListener:
    """Feeds the manager and adds up the time spent in it."""

    def __init__(self, manager: StatLoggerManager) -> None:
        self.manager = manager
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, outputs: EngineCoreOutputs) -> None:
        start = time.perf_counter()
        self.manager.on_outputs(outputs)
        self.seconds += time.perf_counter() - start
        self.calls += 1


def engine_config(args: argparse.Namespace, log_stats: bool) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype),
                        cache=CacheConfig(kv_cache_memory_gib=args.kv_cache_gib),
                        scheduler=SchedulerConfig(max_num_seqs=args.requests),
                        log_stats=log_stats)


async def one_round(client: AsyncEngineClient, args: argparse.Namespace, tag: str) -> float:
    """Output tokens per second of `args.requests` concurrent requests."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    async def request(i: int) -> int:
        ids = client.tokenizer.encode(PROMPTS[i % len(PROMPTS)])
        last = None
        async for output in client.generate(ids, params, f"{tag}-{i}"):
            last = output
        assert last is not None and last.finish_reason == "length"
        return len(last.token_ids)

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(request(i) for i in range(args.requests))))
    return tokens / (time.perf_counter() - start)


def scheduler_step_us(batch: int, log_stats: bool, steps: int = 2000) -> tuple[float, bytes]:
    """Microseconds per scheduler step (schedule, update, stats) for `batch` decoding
    requests without a model, and the encoded outputs of the last step."""
    config = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=8192)
    scheduler = Scheduler(config, KVCacheManager(batch * (steps // 16 + 4), 16), 1 << 20, [2],
                          log_stats=log_stats)
    for i in range(batch):
        params = SamplingParams(max_tokens=steps + 10, ignore_eos=True)
        scheduler.add_request(Request(EngineCoreRequest(f"r{i}", list(range(3, 11)), params,
                                                        time.time()), 1 << 20))
    encoder = msgspec.msgpack.Encoder()
    start = time.perf_counter()
    for _ in range(steps):
        out = scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        outputs = scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, sampled_token_ids=[7] * len(ids)))
        message = EngineCoreOutputs(outputs, time.time(), scheduler.make_stats(),
                                    scheduler.take_iteration_stats())
    elapsed = time.perf_counter() - start
    return 1e6 * elapsed / steps, encoder.encode(message)


def ipc_us(encoded: bytes, repeat: int = 5000) -> float:
    """Microseconds to encode and decode one step's outputs."""
    decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
    encoder = msgspec.msgpack.Encoder()
    message = decoder.decode(encoded)
    start = time.perf_counter()
    for _ in range(repeat):
        decoder.decode(encoder.encode(message))
    return 1e6 * (time.perf_counter() - start) / repeat


def engine_side_cost(batch: int) -> dict[str, float]:
    """Per-step microseconds that stats add in the engine core and on the socket."""
    core = {on: min(scheduler_step_us(batch, on)[0] for _ in range(3)) for on in (True, False)}
    with_stats, without = scheduler_step_us(batch, True)[1], scheduler_step_us(batch, False)[1]
    return {"collector_us": core[True] - core[False],
            "ipc_us": ipc_us(with_stats) - ipc_us(without),
            "extra_bytes": len(with_stats) - len(without)}


async def run(args: argparse.Namespace) -> None:
    with_stats = await AsyncEngineClient.start(engine_config(args, log_stats=True))
    without = await AsyncEngineClient.start(engine_config(args, log_stats=False))
    manager = StatLoggerManager(with_stats.config, with_stats.model_name, None)
    listener = TimedListener(manager)
    with_stats.add_outputs_listener(listener)
    manager.start()
    try:
        await one_round(with_stats, args, "warm-on")
        await one_round(without, args, "warm-off")
        listener.seconds, listener.calls = 0.0, 0
        rates: dict[str, list[float]] = {"on": [], "off": []}
        wall_on = 0.0
        for index in range(args.rounds):
            order = ("on", "off") if index % 2 == 0 else ("off", "on")
            for arm in order:
                client = with_stats if arm == "on" else without
                start = time.perf_counter()
                rates[arm].append(await one_round(client, args, f"{arm}{index}"))
                if arm == "on":
                    wall_on += time.perf_counter() - start
        report(args, rates, listener, wall_on, manager, engine_side_cost(args.requests))
    finally:
        await manager.shutdown()
        await with_stats.shutdown()
        await without.shutdown()


def report(args: argparse.Namespace, rates: dict[str, list[float]], listener: TimedListener,
           wall_on: float, manager: StatLoggerManager, engine_side: dict[str, float]) -> None:
    paired = [1 - on / off for on, off in zip(rates["on"], rates["off"])]
    cost = statistics.median(paired)
    print(f"\nmodel {args.model or 'default (SmolLM2-135M-Instruct)'}, {args.requests} "
          f"concurrent requests x {args.max_tokens} tokens, {args.rounds} rounds per arm")
    print(f"stat loggers: {', '.join(e.name for e in manager.entries)}")
    for arm in ("on", "off"):
        print(f"stats {arm:3}: median {statistics.median(rates[arm]):8.1f} tokens/s   "
              f"rounds: {', '.join(f'{r:.1f}' for r in rates[arm])}")
    print(f"cost of stats, end to end: {100 * cost:+.2f}% of throughput (median of the paired "
          f"rounds; spread {100 * min(paired):+.1f}% .. {100 * max(paired):+.1f}%)")
    step_us = 1e6 * wall_on / max(listener.calls, 1)
    loggers_us = 1e6 * listener.seconds / max(listener.calls, 1)
    parts = {"engine-core collector": engine_side["collector_us"],
             f"socket (+{engine_side['extra_bytes']:.0f} bytes a step)": engine_side["ipc_us"],
             "front-end stat loggers": loggers_us}
    print(f"measured part by part, against a real step of {step_us:.0f} us "
          f"({listener.calls} steps with stats):")
    for name, micros in parts.items():
        print(f"  {name:32} {micros:7.1f} us a step  {100 * micros / step_us:6.3f}%")
    total = sum(parts.values())
    verdict = "meets" if total / step_us < 0.03 else "MISSES"
    print(f"  {'total':32} {total:7.1f} us a step  {100 * total / step_us:6.3f}%   "
          f"({verdict} the target of < 3%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file or HF folder (default: "
                        "the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6, help="rounds per arm")
    parser.add_argument("--kv-cache-gib", type=float, default=0.25)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 8 x 16 tokens")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_tokens, args.rounds = 8, 16, 2
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
