"""The products of quantized GGUF weights (quant_matmul.c, through quant_weight.py) against
torch's product with the dequantized weights: the float32 kernel for float32 and bfloat16
rows, and the AVX512-BF16 kernel for bfloat16 rows where the CPU has it."""

from __future__ import annotations

import gguf
import pytest
import torch

from gateway.models.kernels.cpu.library import load
from gateway.models.kernels.cpu.quant_weight import (
    MAX_BF16_KERNEL_ROWS,
    MAX_KERNEL_ROWS,
    Float32QuantWeight,
    has_bf16_products,
)
from gateway.models.layers.gguf_quant import QuantWeight
from gateway.platforms.cpu_isa import cpu_isa
from tests.models.gguf_weights import KEPT, quantized_weight
from tests.models.kernels.cpu.wide_rows import wide_bf16_rows

# the CPU's instruction set decides the paths; exact products (8-bit activations: test_quant_int8)
pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("exact_float32_products")]

Q = gguf.GGMLQuantizationType
# Relative to the output's largest value, a product stays within this of the dequantized
# weight's float32 product: only the order of the sums differs.
TOLERANCE = 1e-5


def _kernel(weight: QuantWeight) -> Float32QuantWeight:
    library = load()
    assert library is not None, "the float32 kernels did not build here (see the log)"
    return Float32QuantWeight(weight, library)


# weight rows: 96, whole tiles of the many-row path; 83, a part tile of 3 rows
@pytest.mark.parametrize("weight_rows", [96, 83])
@pytest.mark.parametrize("qtype", KEPT)
# up to 7 rows in blocks of 4, from 8 in tiles of 8 weight rows; above 64 a dense matmul
@pytest.mark.parametrize("num_rows", [1, 3, 5, 8, 11, 40, 100])
def test_a_quantized_matmul_is_close_to_the_dequantized_weights(weight_rows: int, qtype: Q,
                                                                num_rows: int) -> None:
    weight, dequantized = quantized_weight(qtype, rows=weight_rows)
    x = torch.randn(num_rows, 256, dtype=torch.float64).float()
    expected = (x.double() @ dequantized.double().t()).float()
    y = _kernel(weight).matmul(x)
    assert y.dtype == torch.float32 and y.shape == expected.shape
    assert (y - expected).abs().max() < TOLERANCE * expected.abs().max()


def test_the_float32_kernels_take_bfloat16_activations() -> None:
    weight, dequantized = quantized_weight(Q.Q4_1)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    with wide_bf16_rows(False):  # the float32 kernel itself, with a conversion each way
        y = _kernel(weight).matmul(x)
    assert y.dtype == torch.bfloat16
    # float32 sums rounded once to bfloat16: within half a bfloat16 step of the exact value
    # (an exact comparison with the float64 product's rounding failed for some inputs)
    exact = x.double() @ dequantized.double().t()
    assert ((y.double() - exact).abs() <= exact.abs() * 2.0**-8 * (1 + 1e-5)).all()


# bfloat16 rows, MIN_ to MAX_BF16_KERNEL_ROWS, run gw_quant_matmul_bf16 where the CPU has
# AVX512-BF16 and the weight's rows are whole blocks of 16 (96 and 80, an odd number of
# blocks; 83 is not): its products of bfloat16 values and codes are exact and summed in
# float32, so it is as close to the dequantized weights as the float32 kernel. Elsewhere
# the float32 kernel runs.
@pytest.mark.parametrize("qtype", KEPT)
@pytest.mark.parametrize("weight_rows", [96, 80, 83])
@pytest.mark.parametrize("num_rows", [2, 4, 7, 17, 40, MAX_BF16_KERNEL_ROWS])
def test_bfloat16_rows_run_the_avx512_bf16_kernel_with_float32_sums(
        qtype: Q, weight_rows: int, num_rows: int) -> None:
    weight, dequantized = quantized_weight(qtype, rows=weight_rows)
    kernel = _kernel(weight)
    x = torch.randn(num_rows, 256).bfloat16()
    expected = x.double() @ dequantized.double().t()
    library = load()
    assert library is not None
    sums = torch.empty(num_rows, weight_rows)  # the kernel's float32 output, before rounding
    status = library.gw_quant_matmul_bf16(
        x.data_ptr(), num_rows, 256, kernel.codes.data_ptr(), kernel.scales.data_ptr(),
        kernel.minimums.data_ptr(), weight_rows, kernel.bits, sums.data_ptr(), 0)
    runs = cpu_isa().has_native_bf16 and weight_rows % 16 == 0
    assert status == (0 if runs else -2)
    assert has_bf16_products() == cpu_isa().has_native_bf16
    if runs:
        assert (sums.double() - expected).abs().max() < 1e-5 * expected.abs().max()
    y = kernel.matmul(x)
    assert y.dtype == torch.bfloat16 and y.shape == expected.shape
    if not runs and num_rows > MAX_KERNEL_ROWS:
        # a dense product of the weight dequantized to bfloat16 (rounded: prefill's path)
        assert (y.double() - expected).abs().max() < 0.01 * expected.abs().max()
        return
    # rounded once to bfloat16 from float32 sums: within half a bfloat16 step, and a little
    assert ((y.double() - expected).abs() <= expected.abs() * 2.0**-8 + 1e-5
            * expected.abs().max()).all()
    with wide_bf16_rows(False):
        assert not has_bf16_products()
        float32_kernel = kernel.matmul(x.float())  # the float32 kernel on the same values
    assert (y.double() - float32_kernel.double()).abs().max() <= 2.0**-8 * expected.abs().max()
