"""Benchmark: the matrix products of one step of the default model with its weights kept
quantized (Q4_1), in the gateway's float32 kernels, against torch's int4 kernel on the same
weights and the dequantized float32 weights (what `--quantization none` runs); the 8-bit activation
kernels (quant_int8.c) on every integer path the instruction-set level allows (AVX2, and
AVX-512 VNNI; `GATEWAY_CPU_ISA=avx2` caps it as an AVX2-only CPU runs); on a CPU with
AVX512-BF16, also bfloat16 activations in the gateway's bfloat16 kernel against the
dequantized bfloat16 weights in oneDNN. Not a test.

The weights have the default model's shapes (30 layers of fused q/k/v, o, fused gate/up and
down projections, and the 49,152-row output layer), random codes and scales; each variant
runs every weight once per "step", and the best of `--repeats` steps is printed, with its
ratio to the float32 kernels and the bytes of weights it read per second.

    .venv/bin/python bench/bench_quant_kernels.py --rows 1 8 32 64 128
    GATEWAY_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
        .venv/bin/python bench/bench_quant_kernels.py --rows 1 8 32 64 128
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# the "float32 kernels" variant is quant_matmul.c's exact product; the 8-bit one is called
# by itself below
os.environ["GATEWAY_CPU_INT8_ACTIVATIONS"] = "0"

from bench.bench_decode import cpu_flags  # noqa: E402
from gateway.models.kernels.cpu import quant_int8  # noqa: E402
from gateway.models.kernels.cpu.library import load  # noqa: E402
from gateway.models.kernels.cpu.quant_weight import (  # noqa: E402
    Float32QuantWeight,
    has_bf16_products,
)
from gateway.models.layers.cpu_linear import PackedLinear, can_pack  # noqa: E402
from gateway.models.layers.gguf_quant import GROUP_SIZE, QuantWeight  # noqa: E402
from gateway.models.layers.quant_linear import Int4Weight  # noqa: E402
from gateway.platforms.cpu_isa import cpu_isa  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [out, in]
NUM_LAYERS, VOCAB = 30, 49152


def random_q4_1(rows: int, cols: int, generator: torch.Generator) -> QuantWeight:
    groups = cols // GROUP_SIZE
    codes = torch.randint(0, 16, (rows, cols), generator=generator, dtype=torch.uint8)
    scale = (torch.rand(rows, groups, generator=generator) * 0.02).half().float()
    minimum = (-torch.rand(rows, groups, generator=generator) * 0.1).half().float()
    return QuantWeight(codes, scale, minimum, 4)


def _interleaved_best_ms(steps: list[Callable[[], object]], repeats: int,
                         clock: Callable[[], float]) -> list[float]:
    """The best of `repeats` runs of each step, the steps taking turns in each round: on a
    machine shared with other work, a busy spell then slows every variant's round alike
    rather than one variant's runs."""
    for step in steps:
        step()  # warm-up
    best = [float("inf")] * len(steps)
    for _ in range(repeats):
        for i, step in enumerate(steps):
            start = clock()
            step()
            best[i] = min(best[i], clock() - start)
    return [1000 * seconds for seconds in best]


def best_ms(step: Callable[[], object], repeats: int) -> float:
    step()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's (and the kernels') threads; default: torch's own")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU time, steadier than wall time where "
                        "other work shares the cores (with --threads 1: the work itself)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    library = load()
    if library is None:
        sys.exit("the float32 kernels cannot run here (see the log line above)")
    generator = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * NUM_LAYERS + [(VOCAB, 576)]
    weights = [random_q4_1(rows, cols, generator) for rows, cols in shapes]
    ours = [Float32QuantWeight(w, library) for w in weights]
    int4 = [Int4Weight(w) for w in weights]
    dense, dense_bf16 = [], []
    with_bf16 = has_bf16_products() and can_pack(torch.device("cpu"), torch.bfloat16)
    for weight in weights:  # as `--quantization none` holds them (cpu_linear.py)
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight.data = weight.dequantize()
        dense.append(PackedLinear(linear, keep_row_weight=True))
        if with_bf16:
            linear.weight.data = linear.weight.data.bfloat16()
            dense_bf16.append(PackedLinear(linear))
    quant_bytes = sum(w.num_bytes() for w in ours)
    dense_bytes = 4 * sum(rows * cols for rows, cols in shapes)
    int8_paths = [path for path in quant_int8.available_paths()
                  if path == quant_int8.Int8Path.AVX2
                  or (path == quant_int8.Int8Path.VNNI and cpu_isa().has_avx512_vnni)]
    print(f"CPU: {cpu_flags()}, avx512_vnni={'yes' if _has_vnni_flag() else 'no'}; "
          f"level {cpu_isa().describe()}; torch threads: {torch.get_num_threads()}; "
          f"clock: {args.clock}; "
          "activations float32" + (", and bfloat16 in the bf16 variants" if with_bf16 else ""))
    print(f"weights per step: {quant_bytes / 2**20:.1f} MiB quantized, "
          f"{dense_bytes / 2**20:.1f} MiB float32")
    print(f"{'rows':>5} {'variant':<22} {'ms/step':>9} {'x float32 kernels':>18} {'GB/s':>7}")
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {cols: torch.randn(rows, cols) for cols in (576, 1536)}
            variants = [("float32 kernels", _step(ours, inputs), quant_bytes),
                        ("dequantized float32", _step(dense, inputs), dense_bytes)]
            if rows <= 8:  # above, Int4Weight dequantizes every weight (seconds a step)
                variants.insert(1, ("torch int4 (bf16)", _step(int4, inputs), quant_bytes))
            variants += [(f"int8 kernel ({path.name.lower()})", _int8_step(ours, inputs, path),
                          quant_bytes) for path in int8_paths]
            if with_bf16 and rows > 1:  # one row: the lone decode's float32 call in either
                halves = {cols: x.bfloat16() for cols, x in inputs.items()}
                variants += [("bf16 kernel", _step(ours, halves), quant_bytes),
                             ("dequantized bf16", _step(dense_bf16, halves), dense_bytes // 2)]
            best = _interleaved_best_ms([step for _, step, _ in variants], args.repeats,
                                        time.process_time if args.clock == "cpu"
                                        else time.perf_counter)
            for (name, _, num_bytes), ms in zip(variants, best, strict=True):
                print(f"{rows:>5} {name:<22} {ms:>9.1f} {ms / best[0]:>18.2f} "
                      f"{num_bytes / ms / 1e6:>7.1f}")


def _has_vnni_flag() -> bool:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return " avx512_vnni" in text


def _int8_step(layers: list[Float32QuantWeight], inputs: dict[int, torch.Tensor],
               path: quant_int8.Int8Path) -> Callable[[], object]:
    """One pass over every weight through 8-bit activations on `path`, at any row count."""
    def step() -> object:
        return [quant_int8.matmul(inputs[w.shape[1]], w.codes, w.scales, w.minimums, w.shape,
                                  w.bits, path) for w in layers]
    return step


def _step(layers: list, inputs: dict[int, torch.Tensor]) -> Callable[[], object]:
    """One pass over every weight, each with the input of its width."""
    def step() -> object:
        return [layer.matmul(inputs[layer.shape[1]]) if hasattr(layer, "matmul")
                else layer(inputs[layer.in_features]) for layer in layers]
    return step


if __name__ == "__main__":
    main()
