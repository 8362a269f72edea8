"""The dequantization of quantized GGUF weights (dequantize.c, through
`Float32QuantWeight.dequantize`) against torch's, `QuantWeight.dequantize`: bit for bit,
whole weights and chosen rows, in float32 and rounded once to bfloat16."""

from __future__ import annotations

import gguf
import pytest
import torch

from gateway.models.kernels.cpu.library import load
from gateway.models.kernels.cpu.quant_weight import Float32QuantWeight
from gateway.models.layers.gguf_quant import QuantWeight
from tests.models.gguf_weights import KEPT, quantized_weight

Q = gguf.GGMLQuantizationType


def _kernel(weight: QuantWeight) -> Float32QuantWeight:
    library = load()
    assert library is not None, "the float32 kernels did not build here (see the log)"
    return Float32QuantWeight(weight, library)


@pytest.mark.parametrize("qtype", KEPT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, [5, 0, 95, 5, 40]])
def test_dequantized_rows_are_torchs_bit_for_bit(qtype: Q, dtype: torch.dtype,
                                                 rows: list[int] | None) -> None:
    # codes times scales are exact in float32 (small integers times half floats), so the
    # sum with the minimum is the one rounding, in either
    weight, _ = quantized_weight(qtype, rows=96, cols=576)
    index = None if rows is None else torch.tensor(rows)
    expected = weight.dequantize() if index is None else weight.dequantize()[index]
    got = _kernel(weight).dequantize(dtype, index)
    assert got.dtype == dtype
    assert torch.equal(got, expected.to(dtype))


def test_the_float32_kernels_dequantize_exactly_and_refuse_rows_outside() -> None:
    weight, dequantized = quantized_weight(Q.Q8_0)
    kernel = _kernel(weight)
    assert torch.equal(kernel.dequantize(torch.float32), dequantized)
    with pytest.raises(IndexError, match="rows outside the weight's 96"):
        kernel.dequantize(torch.float32, torch.tensor([3, 96]))
