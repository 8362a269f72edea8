"""Benchmark: tensor parallelism, N=2 ranks (executor `mp`, one thread per rank) against
N=1 (the worker in this process, one thread), same run, same prompts.

Not a test. Default model, greedy, EOS ignored, random prompts, driven by bench_worker.py's
minimal scheduler (continuous batching, chunked prefill). The sides run in lockstep, one
step each in turn, and each side's tokens/s counts only the time of its own steps: a
machine shared with other work then slows every side alike instead of whichever side
happened to run during a busy spell. N=2's step time includes all it costs: the
engine-core -> rank 0 pipe, rank 0's broadcast to the other ranks, the split model and its
collectives (2 all-reduces per layer, 1 for the embedding, 1 all-gather of the logits).
N=1 with as many threads as N=2 has ranks is printed too: on a CPU machine that is what
an operator would otherwise run. The ranks take one thread each because this process is
pinned to N cores before they start (a worker takes cores / local ranks threads).

    .venv/bin/python bench/bench_tp.py [--dtype bfloat16] [--batch-sizes 1,8,32]
        [--prompt-len 128] [--gen-len 64] [--ranks 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the engine core and workers run
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as torch_mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_worker import Driver, make_prompts  # noqa: E402
from gateway.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig  # noqa: E402
from gateway.executor.mp import MultiprocExecutor, with_master_port  # noqa: E402
from gateway.sampling_params import SamplingParams  # noqa: E402
from gateway.worker.shm_comm import SharedMemoryCollectives, create_buffer_file  # noqa: E402
from gateway.worker.worker import Worker  # noqa: E402
from gateway.worker.worker_proc import LocalSync  # noqa: E402


class Timed:
    """Forwards execute_model to a worker or executor, with this side's torch thread count
    (in-process sides share one pool), counting its steps and their time."""

    def __init__(self, target: object, threads: int | None) -> None:
        self.target, self.threads = target, threads
        self.num_steps, self.seconds = 0, 0.0

    def execute_model(self, scheduler_output):  # type: ignore[no-untyped-def]
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        start = time.perf_counter()
        output = self.target.execute_model(scheduler_output)  # type: ignore[attr-defined]
        self.seconds += time.perf_counter() - start
        self.num_steps += 1
        return output


def config(args: argparse.Namespace, ranks: int) -> EngineConfig:
    return EngineConfig(model=ModelConfig(dtype=args.dtype),
                        cache=CacheConfig(kv_cache_memory_gib=args.kv_cache_memory),
                        parallel=ParallelConfig(tensor_parallel_size=ranks))


def in_process_driver(args: argparse.Namespace, threads: int) -> Driver:
    worker = Worker(config(args, 1))
    worker.init_device()
    torch.set_num_threads(threads)
    worker.load_model()
    return Driver(Timed(worker, threads), worker.initialize_kv_cache())  # type: ignore[arg-type]


def run_in_lockstep(drivers: list[Driver], prompts: list[list[int]],
                    gen_len: int) -> list[tuple[float, float]]:
    """Each side generates `gen_len` tokens for every prompt, one step each in turn;
    returns (output tokens/s, ms per step) per side, from its own steps' time."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=gen_len)
    for driver in drivers:
        driver.worker.num_steps, driver.worker.seconds = 0, 0.0
        for i, prompt in enumerate(prompts):
            driver.add(f"b{len(prompts)}-{i}", prompt, params)
    while any(driver.running for driver in drivers):
        for driver in drivers:
            if driver.running:
                driver.step(driver.token_budget)
                for request in [r for r in driver.running if len(r.output) >= gen_len]:
                    driver.finish(request.req_id)
    return [(len(prompts) * gen_len / d.worker.seconds,
             1000 * d.worker.seconds / d.worker.num_steps) for d in drivers]


def _matmul_loop(rank: int, repeats: int, seconds: object) -> None:
    torch.set_num_threads(1)
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    seconds[rank] = time.perf_counter() - start  # type: ignore[index]


def cores_available(num_processes: int, repeats: int = 600) -> float:
    """How many cores' worth of compute `num_processes` single-threaded processes get
    right now: the same matmul work in 1 process, then in each of `num_processes` at once
    (num_processes on an idle machine with that many cores; less when it is shared)."""
    context = torch_mp.get_context("spawn")
    times = []
    for count in (1, num_processes):
        seconds = context.Array("d", count)
        torch_mp.start_processes(_matmul_loop, args=(repeats, seconds), nprocs=count,
                                 start_method="spawn")
        times.append(max(seconds[:]))
    return num_processes * times[0] / times[1]


def _all_reduce_loop(rank: int, port: int, sync: LocalSync, path: str, repeats: int,
                     seconds: object) -> None:
    """Time `repeats` all-reduces of a decode step's activations [1, 576] bf16, through
    gloo and then through shared memory (rank 0 writes both)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=sync.num_ranks, timeout=timedelta(seconds=60))
    shared = SharedMemoryCollectives(sync, rank, path, 4096)
    tensor = torch.zeros(1, 576, dtype=torch.bfloat16)
    for index, all_reduce in enumerate((dist.all_reduce, shared.all_reduce)):
        for _ in range(20):
            all_reduce(tensor)
        start = time.perf_counter()
        for _ in range(repeats):
            all_reduce(tensor)
        if rank == 0:
            seconds[index] = (time.perf_counter() - start) / repeats  # type: ignore[index]
    dist.destroy_process_group()


def all_reduce_latency_s(num_ranks: int, repeats: int = 500) -> tuple[float, float]:
    """(gloo, shared memory): one all-reduce of [1, 576] bf16 between `num_ranks`
    processes on this machine, what each of a decode step's collectives costs at least."""
    port = with_master_port(EngineConfig()).parallel.master_port
    context = torch_mp.get_context("spawn")
    sync, path = LocalSync(context, num_ranks), create_buffer_file(num_ranks, 4096)
    seconds = context.Array("d", 2)
    try:
        torch_mp.start_processes(_all_reduce_loop, args=(port, sync, path, repeats, seconds),
                                 nprocs=num_ranks, start_method="spawn")
    finally:
        os.unlink(path)
    return seconds[0], seconds[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--kv-cache-memory", type=float, default=0.25)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < args.ranks:
        sys.exit(f"needs {args.ranks} cores, this process may use {len(cores)}")
    os.sched_setaffinity(0, cores[:args.ranks])  # the ranks inherit: one thread each

    executor = MultiprocExecutor(config(args, args.ranks))
    try:
        split = Driver(Timed(executor, None), executor.num_kv_blocks)  # type: ignore[arg-type]
        sides = {f"N={args.ranks} 1t/rank": split,
                 "N=1 1t": in_process_driver(args, 1),
                 f"N=1 {args.ranks}t": in_process_driver(args, args.ranks)}
        drivers = list(sides.values())
        vocab = executor.vocab_size
        run_in_lockstep(drivers, make_prompts(2, 16, vocab, seed=0), 4)  # warm-up
        print(f"{'batch':>5} " + " ".join(f"{name + ' tok/s (ms/step)':>30}" for name in sides)
              + f" {'vs N=1 1t':>10} {f'vs N=1 {args.ranks}t':>10}")
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            prompts = make_prompts(batch, args.prompt_len, vocab, seed=batch)
            results = run_in_lockstep(drivers, prompts, args.gen_len)
            rates = [rate for rate, _ in results]
            print(f"{batch:>5} " + " ".join(f"{f'{rate:.1f} ({ms:.1f})':>30}"
                                             for rate, ms in results)
                  + f" {rates[0] / rates[1]:>10.2f} {rates[0] / rates[2]:>10.2f}", flush=True)
        print(f"ratio = N={args.ranks} tokens/s / N=1 tokens/s ({args.dtype}, prompt "
              f"{args.prompt_len}, {args.gen_len} generated; {len(cores)} cores available, "
              f"{args.ranks} used)")
    finally:
        executor.shutdown()
    print(f"{args.ranks} single-threaded processes got {cores_available(args.ranks):.2f} "
          f"cores' worth of compute (same matmul work, alone vs side by side)")
    num_collectives = 2 * 30 + 2  # SmolLM2-135M: 2 a layer, the embedding, the logits
    for name, seconds in zip(("gloo", "shared memory"), all_reduce_latency_s(args.ranks)):
        print(f"one all-reduce of [1, 576] bf16 through {name}: {seconds * 1e6:.0f} us, "
              f"x {num_collectives} = {seconds * num_collectives * 1e3:.1f} ms a step")


if __name__ == "__main__":
    main()
