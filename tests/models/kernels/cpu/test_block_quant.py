"""Weights kept in their GGUF file's blocks (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q8_0: kquant.h,
through quant_weight.py's BlockQuantWeight): blocks written by our own quantizer dequantize
exactly as gguf-py's dequantizer reads them, and the products of 1 to 100 rows are within
float32 rounding of torch's product with the dequantized weight, for one type and for a
fused weight of several."""

from __future__ import annotations

import gguf
import pytest
import torch

from gateway.models.kernels.cpu.library import load
from gateway.models.kernels.cpu.quant_weight import BlockQuantWeight
from gateway.models.layers.gguf_quant import BlockWeight
from tests.models.gguf_weights import BLOCK_KEPT, block_weight

# the CPU's instruction set decides the paths; the 8-bit activations' K-quant products are
# test_quant_int8's
pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("exact_float32_products")]

Q = gguf.GGMLQuantizationType
# Relative to the output's largest value: only the order of the sums differs.
TOLERANCE = 1e-5


def _kernel(weight: BlockWeight) -> BlockQuantWeight:
    library = load()
    assert library is not None, "the float32 kernels did not build here (see the log)"
    return BlockQuantWeight(weight, library)


@pytest.mark.parametrize("qtype", BLOCK_KEPT)
def test_blocks_dequantize_exactly_as_gguf_reads_them(qtype: Q) -> None:
    weight, dequantized = block_weight(qtype)
    assert torch.equal(weight.dequantize(), dequantized)  # gguf-py's, through BlockWeight
    kernel = _kernel(weight)
    assert kernel.num_bytes() == weight.parts[0].blocks.numel()  # the file's bytes, no more
    assert torch.equal(kernel.dequantize(torch.float32), dequantized)
    rows = torch.tensor([5, 0, 95, 5])
    assert torch.equal(kernel.dequantize(torch.bfloat16, rows), dequantized[rows].bfloat16())


# weight rows 83: a part tile of 3 rows; up to 7 rows of x in blocks of 4, from 8 in tiles
# of 8 weight rows; above 16 (bfloat16 rows: 8, where oneDNN multiplies bfloat16) a dense
# matmul of the dequantized weight
@pytest.mark.parametrize("qtype", BLOCK_KEPT)
@pytest.mark.parametrize("num_rows", [1, 3, 5, 8, 11, 40, 100])
def test_a_block_matmul_is_close_to_the_dequantized_weights(qtype: Q, num_rows: int) -> None:
    weight, dequantized = block_weight(qtype, rows=83)
    x = torch.randn(num_rows, 512, generator=torch.Generator().manual_seed(num_rows))
    expected = (x.double() @ dequantized.double().t()).float()
    y = _kernel(weight).matmul(x)
    assert y.dtype == torch.float32 and y.shape == expected.shape
    assert (y - expected).abs().max() < TOLERANCE * expected.abs().max()
    y16 = _kernel(weight).matmul(x.bfloat16())  # converted each way around the kernel
    assert y16.dtype == torch.bfloat16
    exact = x.bfloat16().double() @ dequantized.double().t()
    assert (y16.double() - exact).abs().max() < 0.01 * exact.abs().max()


@pytest.mark.parametrize("num_rows", [1, 8])
def test_a_fused_weight_of_several_block_types_runs_as_one(num_rows: int) -> None:
    """q and k Q4_K with v Q6_K (a Q4_K_M file's attention), then Q8_0 and Q5_0 parts."""
    parts = [block_weight(qtype, rows=rows, seed=seed)
             for seed, (qtype, rows) in enumerate([(Q.Q4_K, 32), (Q.Q4_K, 16), (Q.Q6_K, 16),
                                                   (Q.Q8_0, 8), (Q.Q5_0, 8)])]
    fused = BlockWeight.cat_rows([weight for weight, _ in parts])
    assert [part.qtype for part in fused.parts] == [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0]
    dequantized = torch.cat([values for _, values in parts])
    assert fused.shape == (80, 512) and torch.equal(fused.dequantize(), dequantized)
    kernel = _kernel(fused)
    assert torch.equal(kernel.dequantize(torch.float32), dequantized)
    x = torch.randn(num_rows, 512, generator=torch.Generator().manual_seed(0))
    expected = (x.double() @ dequantized.double().t()).float()
    assert (kernel.matmul(x) - expected).abs().max() < TOLERANCE * expected.abs().max()
    with pytest.raises(ValueError, match="several block types cannot be cut"):
        fused.narrow(0, 0, 8)


def test_columns_off_the_blocks_cannot_be_cut() -> None:
    weight, dequantized = block_weight(Q.Q4_K)
    cut = weight.narrow(1, 256, 256)
    assert cut.shape == (96, 256) and torch.equal(cut.dequantize(), dequantized[:, 256:])
    assert torch.equal(weight.narrow(0, 10, 20).dequantize(), dequantized[10:30])
    with pytest.raises(ValueError, match="do not fall on the Q4_K blocks of 256"):
        weight.narrow(1, 128, 256)
