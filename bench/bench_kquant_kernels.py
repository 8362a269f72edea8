"""Benchmark: the matrix products of one step of a Q4_K_M-shaped model kept in its file's
blocks (Q4_K, and Q6_K for v and every other down projection, as llama.cpp's Q4_K_M mix
does), in the gateway's block kernels (kquant.h), against the same weights dequantized to
float32 in torch (what `--quantization none` runs; oneDNN-packed as cpu_linear keeps them).
Not a test.

The weights have Qwen3-0.6B's shapes (fused q/k/v [4096, 1024], o [1024, 2048], fused
gate/up [6144, 1024], down [1024, 3072]; `--layers` of its 28, no output layer), random
values quantized by tests/models/gguf_weights.py's quantizer. Each variant runs every
weight once per "step"; the best of `--repeats` steps is printed, with its ratio to the
block kernels and the bytes of weights it read per second.

    .venv/bin/python bench/bench_kquant_kernels.py --rows 1 4 16 32 64 128 --layers 8 [--threads N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_decode import cpu_flags  # noqa: E402
from bench.bench_quant_kernels import _step, best_ms  # noqa: E402
from gateway.models.kernels.cpu.library import load  # noqa: E402
from gateway.models.kernels.cpu.quant_weight import BlockQuantWeight  # noqa: E402
from gateway.models.layers.cpu_linear import PackedLinear  # noqa: E402
from gateway.models.layers.gguf_quant import BlockWeight  # noqa: E402
from tests.models.gguf_weights import Q, quantize_blocks  # noqa: E402

HIDDEN, HEADS_DIM, KV_DIM, INTERMEDIATE = 1024, 2048, 1024, 3072


def _weight(parts: list[tuple[Q, int]], cols: int, rng: np.random.Generator) -> BlockWeight:
    """A weight of `parts` (type, rows) stacked by rows, random values quantized."""
    weights = []
    for qtype, rows in parts:
        values = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
        block = BlockWeight.from_gguf(quantize_blocks(values, qtype).reshape(-1), qtype,
                                      (rows, cols))
        assert block is not None
        weights.append(block)
    return BlockWeight.cat_rows(weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's (and the kernels') threads; default: torch's own")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    library = load()
    if library is None:
        sys.exit("the float32 kernels cannot run here (see the log line above)")
    rng = np.random.default_rng(0)
    weights = []
    for layer in range(args.layers):
        down = Q.Q6_K if layer % 2 == 0 else Q.Q4_K
        weights += [_weight([(Q.Q4_K, HEADS_DIM + KV_DIM), (Q.Q6_K, KV_DIM)], HIDDEN, rng),
                    _weight([(Q.Q4_K, HIDDEN)], HEADS_DIM, rng),
                    _weight([(Q.Q4_K, 2 * INTERMEDIATE)], HIDDEN, rng),
                    _weight([(down, HIDDEN)], INTERMEDIATE, rng)]
    ours = [BlockQuantWeight(w, library) for w in weights]
    dense = []
    for weight in weights:  # as `--quantization none` holds them (cpu_linear.py)
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight.data = weight.dequantize()
        dense.append(PackedLinear(linear, keep_row_weight=True))
    quant_bytes = sum(w.num_bytes() for w in ours)
    dense_bytes = 4 * sum(w.shape[0] * w.shape[1] for w in weights)
    print(f"CPU: {cpu_flags()}; torch threads: {torch.get_num_threads()}; activations float32")
    print(f"weights per step: {quant_bytes / 2**20:.1f} MiB in blocks, "
          f"{dense_bytes / 2**20:.1f} MiB float32")
    print(f"{'rows':>5} {'variant':<22} {'ms/step':>9} {'x block kernels':>16} {'GB/s':>7}")
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {cols: torch.randn(rows, cols) for cols in (HIDDEN, HEADS_DIM,
                                                                 INTERMEDIATE)}
            first = None
            for name, step, num_bytes in [("block kernels", _step(ours, inputs), quant_bytes),
                                          ("dequantized float32", _step(dense, inputs),
                                           dense_bytes)]:
                ms = best_ms(step, args.repeats)
                first = first or ms
                print(f"{rows:>5} {name:<22} {ms:>9.1f} {ms / first:>16.2f} "
                      f"{num_bytes / ms / 1e6:>7.1f}")


if __name__ == "__main__":
    main()
