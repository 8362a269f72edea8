"""Benchmark: embeddings/s of the gateway's pooling worker against transformers + mean
pooling (what sentence-transformers' `encode` runs), on all-MiniLM-L6-v2, same run.

Not a test. The worker is driven in-process with one SchedulerOutput per batch (token ids
in, no tokenizer, no engine core, no HTTP). The reference tokenizes the batch (padding to
its longest sentence), runs `AutoModel` in float32 and mean-pools with the attention mask,
then L2-normalises, as sentence-transformers does; "ref model only" times it without the
tokenizer. Rounds interleave the sides so a busy machine slows both alike. Also prints the
cosine distance of each dtype's embeddings from float32's.

    .venv/bin/python bench/bench_pooling_runner.py [--dtypes float32,bfloat16]
        [--batch 32] [--rounds 5] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.config import EngineConfig, ModelConfig
from gateway.messages import NewRequestData, PoolingParams, SchedulerOutput
from gateway.models.info.paths import default_embedding_model_path
from gateway.sampling_params import SamplingParams
from gateway.tokenizer import load_tokenizer
from gateway.worker.worker import Worker

T = TypeVar("T")

_WORDS = ["the", "a", "server", "model", "request", "answer", "quickly", "slowly", "river",
          "mountain", "city", "night", "embedding", "vector", "search", "document", "query",
          "ranks", "returns", "every", "small", "large", "green", "engineer", "writes", "reads",
          "code", "test", "batch", "token", "sentence", "meaning", "similar", "different",
          "weather", "today", "tomorrow", "because", "while", "after", "before", "coffee",
          "music", "learns"]


def make_sentences(count: int, seed: int) -> list[str]:
    """`count` sentences of 10-20 words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(10, 20))).capitalize() + "."
            for _ in range(count)]


def scheduler_output(batches: list[list[int]], start: int) -> SchedulerOutput:
    new = [NewRequestData(req_id=str(start + i), prompt_token_ids=ids,
                          sampling_params=SamplingParams(), block_ids=[],
                          pooling_params=PoolingParams()) for i, ids in enumerate(batches)]
    return SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=[],
                           num_scheduled_tokens={r.req_id: len(r.prompt_token_ids) for r in new},
                           finished_req_ids=[])


def embed_ours(worker: Worker, token_ids: list[list[int]]) -> np.ndarray:
    output = worker.execute_model(scheduler_output(token_ids, 0))
    return np.stack([np.frombuffer(output.pooler_outputs[str(i)], dtype=np.float32)
                     for i in range(len(token_ids))])


class Reference:
    """transformers' AutoModel + attention-masked mean pooling + L2 normalisation."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()

    def tokenize(self, sentences: list[str]) -> dict[str, torch.Tensor]:
        return dict(self.tokenizer(sentences, padding=True, return_tensors="pt"))

    @torch.inference_mode()
    def embed(self, inputs: dict[str, torch.Tensor]) -> np.ndarray:
        hidden = self.model(**inputs).last_hidden_state  # [B, L, E]
        mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).numpy()


def _each(items: list[T], fn: Callable[[T], object]) -> Callable[[], int]:
    """A callable that applies `fn` to every item and returns how many there were."""
    def run() -> int:
        for item in items:
            fn(item)
        return len(items)
    return run


def rate(run: Callable[[], int], batch: int) -> float:
    """Embeddings per second of `run` (which embeds that many batches of `batch`)."""
    start = time.perf_counter()
    num_batches = run()
    return num_batches * batch / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="batches per timed round")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for both sides (default: the worker's, all cores)")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    folder = default_embedding_model_path()
    tokenizer = load_tokenizer(folder)
    # Fresh sentences for every step, so each step's token count is new, as in serving.
    rounds = [[make_sentences(args.batch, r * args.steps + i) for i in range(args.steps)]
              for r in range(args.rounds + 1)]
    workers = {}
    for dtype in args.dtypes.split(","):
        workers[dtype] = Worker(EngineConfig(model=ModelConfig(model=str(folder), dtype=dtype)))
        workers[dtype].init_device()
        workers[dtype].load_model()
    if args.threads:
        torch.set_num_threads(args.threads)
    reference = Reference(folder)
    results: dict[str, list[float]] = {name: [] for name in
                                       [f"ours {d}" for d in workers] + ["ref", "ref model only"]}
    token_ids: list[list[list[int]]] = []
    for batches in rounds:  # the first round warms up
        token_ids = [[tokenizer.encode(s) for s in batch] for batch in batches]
        inputs = [reference.tokenize(batch) for batch in batches]
        for dtype, worker in workers.items():
            results[f"ours {dtype}"].append(rate(
                _each(token_ids, lambda ids, w=worker: embed_ours(w, ids)), args.batch))
        results["ref"].append(rate(
            _each(batches, lambda batch: reference.embed(reference.tokenize(batch))), args.batch))
        results["ref model only"].append(rate(_each(inputs, reference.embed), args.batch))
    tokens = sum(len(ids) for batch in token_ids for ids in batch) / (args.steps * args.batch)
    print(f"\nall-MiniLM-L6-v2, batches of {args.batch} sentences of 10-20 words "
          f"({tokens:.1f} tokens on average), {torch.get_num_threads()} threads, load average "
          f"{load_before:.1f} before / {os.getloadavg()[0]:.1f} after")
    ref_median = float(np.median(results["ref"][1:]))
    print(f"{'':<16} {'median emb/s':>12} {'best emb/s':>10} {'vs ref':>7}")
    for name, rates in results.items():
        median = float(np.median(rates[1:]))
        print(f"{name:<16} {median:>12.0f} {max(rates[1:]):>10.0f} {median / ref_median:>6.2f}x")
    fp32 = reference.embed(reference.tokenize(rounds[-1][0]))
    for dtype, worker in workers.items():
        distances = 1 - (embed_ours(worker, token_ids[0]) * fp32).sum(-1)
        print(f"cosine distance, ours {dtype} vs transformers float32: "
              f"max {distances.max():.2e}, mean {distances.mean():.2e}")


if __name__ == "__main__":
    main()
