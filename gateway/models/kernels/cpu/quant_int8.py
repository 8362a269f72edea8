"""8-bit activations for the products of Q4_0, Q4_1 and Q8_0 weights (quant_int8.c: x
quantized to int8 a group of 32 columns) and of Q4_K, Q5_K and Q6_K weights in their file's
blocks (kquant_int8.c: a block of 256 columns, one K-quant super-block), in the worker:
integer dot products (AVX-512 VNNI or AVX2), `reference_matmul` the same math in torch. Off
unless GATEWAY_CPU_INT8_ACTIVATIONS=1 (docs/quantization.md says why).
"""

from __future__ import annotations

import enum
import functools

import torch

from gateway import envs
from gateway.logger import init_logger
from gateway.models.kernels.cpu.library import load
from gateway.platforms.cpu_isa import cpu_isa

logger = init_logger(__name__)

GROUP = 32
K_GROUP = 256  # the K-quants' super-block, over which x shares one scale
# Rows of x a product takes through 8-bit activations: in this range the integer products
# took less time than the float32 paths where measured (docs/cpu-performance.md). Fewer
# rows read the weights at memory speed either way (and gain nothing for the 8-bit step's
# error): the float32 kernels; more (a long prefill): a dense matmul of the weight
# dequantized, as without them. bfloat16 rows keep the bfloat16 kernel where it runs: the
# integer products were faster in the kernels' benchmark but not through HTTP.
MIN_INT8_ROWS, MAX_INT8_ROWS = 4, 256


class Int8Path(enum.IntEnum):
    """quant_int8.c's paths."""
    SCALAR = 1
    AVX2 = 2
    VNNI = 3


def available_paths() -> list[Int8Path]:
    """The paths this CPU runs (whatever the level allowed)."""
    library = load()
    if library is None:
        return []
    mask = library.gw_int8_paths()
    return [path for path in Int8Path if mask & (1 << path)]


def int8_path() -> Int8Path | None:
    """The path the products of few rows take here, or None where 8-bit activations are
    off (GATEWAY_CPU_INT8_ACTIVATIONS unset or 0, or no kernels). Logged once a process."""
    return _chosen_path(envs.cpu_int8_activations())


@functools.cache
def _chosen_path(enabled: bool) -> Int8Path | None:
    if not enabled:
        logger.info("Quantized CPU products: exact float32 activations "
                    "(GATEWAY_CPU_INT8_ACTIVATIONS=1 would quantize them to 8 bits)")
        return None
    paths = available_paths()
    if not paths:
        return None
    isa = cpu_isa()
    path = Int8Path.VNNI if isa.has_avx512_vnni and Int8Path.VNNI in paths else Int8Path.AVX2
    logger.info("Quantized CPU products of %d to %d rows: 8-bit activations, %s integer dot "
                "products (%s; GATEWAY_CPU_INT8_ACTIVATIONS=0 keeps exact float32 ones)",
                MIN_INT8_ROWS, MAX_INT8_ROWS, "AVX-512 VNNI" if path == Int8Path.VNNI else "AVX2",
                isa.describe())
    return path


def matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
           minimums: torch.Tensor, shape: tuple[int, int], bits: int,
           path: Int8Path) -> torch.Tensor:
    """x [M, K] float32 contiguous -> x W^T [M, N] float32, for W in the kernels' layout
    (quant_weight.Float32QuantWeight's codes, scales, minimums)."""
    library = load()
    assert library is not None, "a path was chosen, so the kernels are loaded"
    y = torch.empty(x.shape[0], shape[0], dtype=torch.float32)
    status = library.gw_quant_matmul_int8(
        x.data_ptr(), x.shape[0], shape[1], codes.data_ptr(), scales.data_ptr(),
        minimums.data_ptr(), shape[0], bits, y.data_ptr(), int(path))
    if status == -1:
        raise MemoryError("the 8-bit activation kernel could not allocate its buffer")
    if status != 0:
        raise ValueError(f"the 8-bit activation kernel refused path {path.name} here")
    return y


def kquant_matmul(x: torch.Tensor, parts_address: int, shape: tuple[int, int],
                  path: Int8Path) -> torch.Tensor:
    """x [M, K] float32 contiguous -> x W^T [M, N] float32, for W in its file's blocks, every
    part Q4_K, Q5_K or Q6_K (quant_weight.BlockQuantWeight's record of them)."""
    library = load()
    assert library is not None, "a path was chosen, so the kernels are loaded"
    y = torch.empty(x.shape[0], shape[0], dtype=torch.float32)
    status = library.gw_kquant_matmul_int8(x.data_ptr(), x.shape[0], shape[1], parts_address,
                                           shape[0], y.data_ptr(), int(path))
    if status == -1:
        raise MemoryError("the 8-bit activation kernel could not allocate its buffer")
    if status != 0:
        raise ValueError(f"the 8-bit activation kernel refused path {path.name} (or a block "
                         "type other than Q4_K, Q5_K, Q6_K) here")
    return y


def quantize(x: torch.Tensor, path: Int8Path = Int8Path.AVX2,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 as the kernels quantize it: q [M, K] int8, d and d * sum(q)
    [M, K / 32] float32."""
    library = load()
    assert library is not None, "the kernels must build here"
    rows, cols = x.shape
    x = x.contiguous()
    q = torch.empty(rows, cols, dtype=torch.int8)
    d = torch.empty(rows, cols // GROUP)
    dsum = torch.empty(rows, cols // GROUP)
    if library.gw_quantize_int8(x.data_ptr(), rows, cols, q.data_ptr(), d.data_ptr(),
                                dsum.data_ptr(), int(path)) != 0:
        raise ValueError(f"path {path.name} does not run here, or {cols} is not whole groups")
    return q, d, dsum


def reference_quantize(x: torch.Tensor, group: int = GROUP,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize` in torch: the same float32 operations, rounding to nearest even (`group`
    K_GROUP: as kquant_int8.c quantizes)."""
    groups = x.float().reshape(x.shape[0], -1, group)
    d = groups.abs().amax(-1) / 127.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(groups * inverse.unsqueeze(-1))
    return (q.to(torch.int8).reshape(x.shape), d,
            d * q.sum(-1, dtype=torch.float64).float())


def reference_matmul(x: torch.Tensor, dequantized: torch.Tensor,
                     group: int = GROUP) -> torch.Tensor:
    """What the kernels compute, in float64: x quantized to int8 a group of `group` columns
    (K_GROUP for the K-quants), dequantized, times the dequantized weight [N, K]."""
    q, d, _ = reference_quantize(x, group)
    approximation = q.double().reshape(x.shape[0], -1, group) * d.double().unsqueeze(-1)
    return approximation.reshape(x.shape) @ dequantized.double().t()
