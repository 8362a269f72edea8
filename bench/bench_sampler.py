"""Benchmark: time per `Sampler.sample()` call against vLLM's PyTorch-native sampler pattern.

Not a test. A 49,152-token vocabulary (the default model's), 32 and 64 rows, several
mixes of sampling parameters, on logits that are peaked (an LLM's usual) or flat (high
entropy: wide top-p nuclei). The peer, timed in the same run on the same logits, is the
reference pattern: temperature, a full sort for top-k with top-p (a top-k-only batch uses
topk), softmax, min-p, and an exponential race over the vocabulary. Medians of --repeat.

    .venv/bin/python bench/bench_sampler.py [--rows 32,64] [--threads 2] [--repeat 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.config import ModelConfig  # noqa: E402
from gateway.plugins.contracts import BatchUpdate  # noqa: E402
from gateway.sampling_params import SamplingParams as Params  # noqa: E402
from gateway.worker.sampler import Sampler  # noqa: E402

VOCAB = 49152
MIXES = {
    "greedy": [Params(temperature=0.0)],
    "temperature": [Params(temperature=0.8)],
    "top-k 50": [Params(temperature=0.8, top_k=50)],
    "top-p 0.95": [Params(temperature=1.0, top_p=0.95)],
    "mixed": [Params(temperature=0.0), Params(temperature=0.7, seed=1),
              Params(temperature=0.8, top_p=0.95), Params(min_p=0.05),
              Params(temperature=1.0, top_k=50, top_p=0.9, seed=2)],
}
SHAPES = {"peaked": 4.0, "flat": 1.0}  # the logits' standard deviation


def reference_sample(logits: torch.Tensor, params: list[Params]) -> torch.Tensor:
    """vLLM's PyTorch-native path: sort-based top-k/top-p, exponential-race sampling."""
    greedy = logits.argmax(-1)
    if all(p.temperature == 0.0 for p in params):
        return greedy
    temps = torch.tensor([p.temperature or 1.0 for p in params]).unsqueeze(1)
    logits = logits / temps
    k = torch.tensor([p.top_k or VOCAB for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    if any(p.top_p < 1.0 for p in params):
        ordered, order = logits.sort(-1)
        kth = ordered.gather(1, (VOCAB - k).unsqueeze(1))
        ordered.masked_fill_(ordered < kth, float("-inf"))
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p.unsqueeze(1)
        drop[:, -1] = False
        logits = ordered.masked_fill_(drop, float("-inf")).scatter(1, order, ordered)
    elif any(p.top_k for p in params):
        kth = logits.topk(int(k.max()), -1).values.gather(1, (k.clamp(max=int(k.max())) - 1)
                                                           .unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)
    if (min_p > 0).any():
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    sampled = probs.div_(torch.empty_like(probs).exponential_()).argmax(-1)
    is_greedy = torch.tensor([p.temperature == 0.0 for p in params])
    return torch.where(is_greedy, greedy, sampled)


def median_ms(run: Callable[[torch.Tensor], object], base: torch.Tensor, repeat: int) -> float:
    """Median time of run(fresh copy of base), after two warm-up calls."""
    times = []
    for _ in range(repeat + 2):
        logits = base.clone()
        start = time.perf_counter()
        run(logits)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="32,64")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"vocab {VOCAB}, {args.threads} threads, median of {args.repeat}; ms per call")
    print(f"{'logits':7s} {'rows':>4s} {'mix':12s} {'ours':>8s} {'reference':>10s} {'ratio':>6s}")
    for shape, scale in SHAPES.items():
        for num_rows in (int(n) for n in args.rows.split(",")):
            base = torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(0))
            base *= scale
            for mix, pattern in MIXES.items():
                params = [pattern[i % len(pattern)] for i in range(num_rows)]
                sampler = Sampler(ModelConfig(), VOCAB, [2], torch.device("cpu"))
                sampler.update_state(BatchUpdate(num_rows, added=[
                    (row, p, [1], []) for row, p in enumerate(params)]))
                rows = list(range(num_rows))
                ours = median_ms(partial(sampler.sample, rows=rows), base, args.repeat)
                ref = median_ms(partial(reference_sample, params=params), base, args.repeat)
                print(f"{shape:7s} {num_rows:4d} {mix:12s} {ours:8.2f} {ref:10.2f} "
                      f"{ref / ours:5.1f}x", flush=True)


if __name__ == "__main__":
    main()
