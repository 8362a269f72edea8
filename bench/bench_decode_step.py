"""Benchmark: one batch-1 decode step in process, against a plain transformers forward.
Not a test.

Three decoders of the same depth run decode steps of one sequence, interleaved round by
round so a busy machine slows them alike:
- ours: the gateway's worker (the default model dequantized to float32, its own runner
  and sampler), its lone decode in one C call; ours-torch: the same step through torch's
  ops;
- with --quantized, ours-q4 and ours-q4-torch: the same with the GGUF's Q4_1 weights kept
  quantized (the server's default on a CPU), the lone decode in one C call and through
  torch's ops;
- transformers: `LlamaForCausalLM` with the same GGUF's weights, one token per forward
  with its own KV cache, then argmax (the plain-PyTorch reference);
- overhead: the gateway's worker on a random Llama of the same depth and heads but
  hidden size 64, whose matmuls cost next to nothing: what is left is the per-step
  overhead of our stack (Python, op dispatch, the runner's bookkeeping, the sampler).
Every figure is also printed as a ratio to transformers'. With one thread (the default)
the clock is this thread's CPU time, which time slices taken by other processes do not
inflate; with more threads it is wall time. `--profile` adds torch.profiler's view of
our step: op dispatches per step and the self CPU time of the busiest ops.

    .venv/bin/python bench/bench_decode_step.py
    .venv/bin/python bench/bench_decode_step.py --threads 2 --profile
    .venv/bin/python bench/bench_decode_step.py --quantized --no-hf
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_worker import load_hf_model  # noqa: E402
from gateway.config import CacheConfig, EngineConfig, ModelConfig  # noqa: E402
from gateway.sampling_params import SamplingParams  # noqa: E402
from gateway.worker.worker import Worker  # noqa: E402
from tests.step_driver import StepDriver  # noqa: E402
from tests.tiny_model import build_tiny_llama  # noqa: E402

Step = Callable[[], None]


def our_step(model: str | None, prompt: list[int], quantization: str = "none",
             one_call: bool = True) -> tuple[Step, StepDriver]:
    worker = Worker(EngineConfig(model=ModelConfig(model=model, dtype="float32",
                                                   quantization=quantization),
                                 cache=CacheConfig(kv_cache_memory_gib=0.1)))
    worker.init_device()
    worker.load_model()
    assert worker.model_runner is not None
    if not one_call:  # the lone decode through torch's ops (lone_decode.py)
        worker.model_runner.lone_decode = None
    driver = StepDriver(worker, worker.initialize_kv_cache())
    driver.add("r", prompt, SamplingParams(temperature=0.0, ignore_eos=True,
                                           max_tokens=1_000_000))
    driver.step()  # the prefill

    def step() -> None:
        driver.step()
    return step, driver


def hf_step(prompt: list[int]) -> Step:
    model = load_hf_model(torch.float32)
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
    state = {"out": out}

    @torch.inference_mode()
    def step() -> None:
        token = state["out"].logits[0, -1].argmax().view(1, 1)
        state["out"] = model(token, past_key_values=state["out"].past_key_values,
                             use_cache=True)
    return step


def overhead_model(folder: Path, real: Worker) -> str:
    """A random Llama as deep as the default model, with its head layout, hidden size 64."""
    config = real.model_runner.model.config  # type: ignore[union-attr]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    return str(build_tiny_llama(folder, num_hidden_layers=config.num_hidden_layers,
                                hidden_size=4 * heads, intermediate_size=8 * heads,
                                num_attention_heads=heads, num_key_value_heads=kv_heads,
                                head_dim=4))


def measure(steps: dict[str, Step], rounds: int, clock: Callable[[], float]
            ) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = clock()
            step()
            times[name].append(clock() - start)
    return times


def profile(step: Step, num_steps: int = 5) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            step()
    averages = prof.key_averages()
    total_us = sum(event.self_cpu_time_total for event in averages) / num_steps
    print(f"\nour step under torch.profiler: {sum(e.count for e in averages) / num_steps:.0f} "
          f"op dispatches per step (nested ones included), {total_us / 1000:.1f} ms of op "
          f"self CPU time per step (the profiler's own cost included)")
    print(f"{'op':<52}{'calls/step':>11}{'self ms/step':>13}{'share':>7}")
    for event in sorted(averages, key=lambda e: -e.self_cpu_time_total)[:15]:
        share = event.self_cpu_time_total / num_steps / total_us
        print(f"{event.key[:51]:<52}{event.count / num_steps:>11.0f}"
              f"{event.self_cpu_time_total / num_steps / 1000:>13.2f}{share:>7.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--quantized", action="store_true",
                        help="add the default model with its weights kept quantized (Q4_1, "
                             "the float32 kernels): its lone decode in one C call "
                             "(ours-q4) and through torch (ours-q4-torch)")
    args = parser.parse_args()
    prompt = list(range(100, 100 + args.prompt_len))
    steps: dict[str, Step] = {}
    steps["ours"], driver = our_step(None, prompt)
    steps["ours-torch"], _ = our_step(None, prompt, one_call=False)
    if args.quantized:
        steps["ours-q4"], _ = our_step(None, prompt, "gguf")
        steps["ours-q4-torch"], _ = our_step(None, prompt, "gguf", one_call=False)
    if not args.no_hf:
        steps["transformers"] = hf_step(prompt)
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        steps["overhead"], _ = our_step(overhead_model(Path(tmp) / "m", driver.worker), prompt)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    measure(steps, 5, clock)  # warm-up
    load_before = os.getloadavg()[0]
    times = measure(steps, args.rounds, clock)
    base = statistics.median(times.get("transformers", times["ours"]))
    print(f"\nbatch-1 decode step, float32, {args.threads} thread(s), context from "
          f"{args.prompt_len} tokens, {args.rounds} rounds; clock: "
          f"{'thread CPU time' if args.threads == 1 else 'wall'}; load average "
          f"{load_before:.1f} before / {os.getloadavg()[0]:.1f} after")
    print(f"{'decoder':<14}{'p50 ms':>9}{'p25 ms':>9}{'x transformers':>16}")
    for name, values in times.items():
        values.sort()
        p50 = statistics.median(values)
        print(f"{name:<14}{1000 * p50:>9.2f}{1000 * values[len(values) // 4]:>9.2f}"
              f"{p50 / base:>16.2f}")
    if args.profile:
        profile(steps["ours"])


if __name__ == "__main__":
    main()
