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

With `--int8`, instead: for Q4_K, Q5_K and Q6_K weights each, the products through 8-bit
activations (kquant_int8.c, GATEWAY_CPU_INT8_ACTIVATIONS=1's path) on every integer path the
instruction-set level allows, against the path BlockQuantWeight takes today without them
(the float32 block kernels up to 16 rows, a dense product of the weight dequantized above),
on two sets of shapes: the default model's 30 down projections [576, 1536] (the only weights
of its that K-quant blocks can hold: its other inputs are 576 columns, not whole blocks of
256, which llama.cpp's K-quant files store as Q5_0 or Q8_0), and `--layers` layers of the
Qwen3-0.6B shapes above. `GATEWAY_CPU_ISA=avx2` runs it as an AVX2-only CPU would:

    .venv/bin/python bench/bench_kquant_kernels.py --int8 --rows 8 32 128 --threads 1 \
        --clock cpu
    GATEWAY_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
        .venv/bin/python bench/bench_kquant_kernels.py --int8 --rows 8 32 128 --threads 1 \
        --clock cpu
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_decode import cpu_flags  # noqa: E402
from bench.bench_quant_kernels import (  # noqa: E402
    _has_vnni_flag,
    _interleaved_best_ms,
    _step,
    best_ms,
)
from gateway.models.kernels.cpu import quant_int8  # noqa: E402
from gateway.models.kernels.cpu.library import load  # noqa: E402
from gateway.models.kernels.cpu.quant_weight import BlockQuantWeight  # noqa: E402
from gateway.models.layers.cpu_linear import PackedLinear  # noqa: E402
from gateway.models.layers.gguf_quant import BlockWeight  # noqa: E402
from gateway.platforms.cpu_isa import cpu_isa  # noqa: E402
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
    parser.add_argument("--int8", action="store_true",
                        help="the 8-bit activation products against today's float path")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="with --int8, cpu: this process's CPU time, steadier than wall "
                        "time where other work shares the cores (with --threads 1: the work)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    library = load()
    if library is None:
        sys.exit("the float32 kernels cannot run here (see the log line above)")
    if args.int8:
        int8_table(args, library)
        return
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


DEFAULT_MODEL_DOWN, DEFAULT_MODEL_LAYERS = (576, 1536), 30
QWEN3_SHAPES = [(HEADS_DIM + 2 * KV_DIM, HIDDEN), (HIDDEN, HEADS_DIM), (2 * INTERMEDIATE, HIDDEN),
                (HIDDEN, INTERMEDIATE)]


def _int8_step(layers: list[BlockQuantWeight], inputs: dict[int, torch.Tensor],
               path: quant_int8.Int8Path) -> Callable[[], object]:
    """One pass over every weight through 8-bit activations on `path`, at any row count."""
    def step() -> object:
        return [quant_int8.kquant_matmul(inputs[w.shape[1]], w.address, w.shape, path)
                for w in layers]
    return step


def int8_table(args: argparse.Namespace, library: ctypes.CDLL) -> None:
    """`--int8`'s table (the module's docstring)."""
    paths = [path for path in quant_int8.available_paths()
             if path == quant_int8.Int8Path.AVX2
             or (path == quant_int8.Int8Path.VNNI and cpu_isa().has_avx512_vnni)]
    print(f"CPU: {cpu_flags()}, avx512_vnni={'yes' if _has_vnni_flag() else 'no'}; "
          f"level {cpu_isa().describe()}; torch threads: {torch.get_num_threads()}; "
          f"clock: {args.clock}; activations float32; best of interleaved rounds")
    shape_sets = [(f"default model: {DEFAULT_MODEL_LAYERS} x down {list(DEFAULT_MODEL_DOWN)}",
                   [DEFAULT_MODEL_DOWN] * DEFAULT_MODEL_LAYERS),
                  (f"Qwen3-0.6B: {args.layers} layers", QWEN3_SHAPES * args.layers)]
    print(f"{'shapes':<34} {'type':<5} {'rows':>5} {'variant':<20} {'ms/step':>9} "
          f"{'x float path':>13}")
    rng = np.random.default_rng(0)
    with torch.inference_mode():
        for label, shapes in shape_sets:
            for qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
                layers = [BlockQuantWeight(_weight([(qtype, rows)], cols, rng), library)
                          for rows, cols in shapes]
                for rows in args.rows:
                    inputs = {cols: torch.randn(rows, cols) for _, cols in shapes}
                    variants = [("float path (today)", _step(layers, inputs))]
                    variants += [(f"int8 ({path.name.lower()})", _int8_step(layers, inputs, path))
                                 for path in paths]
                    best = _interleaved_best_ms([step for _, step in variants], args.repeats,
                                                time.process_time if args.clock == "cpu"
                                                else time.perf_counter)
                    for (name, _), ms in zip(variants, best, strict=True):
                        print(f"{label:<34} {qtype.name:<5} {rows:>5} {name:<20} {ms:>9.2f} "
                              f"{ms / best[0]:>13.2f}")


if __name__ == "__main__":
    main()
