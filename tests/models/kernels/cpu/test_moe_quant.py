"""The experts' grouped product with their weights kept quantized (moe_quant.c, through
moe_quant.py's ExpertsWeight): every routed row times its own expert's weight, for each
type the experts keep, equals torch's product with each row's expert's dequantized weight
(layers/moe.py's gathered_linear, in float64) within float32 rounding: a decode step's
few rows an expert, a prefill's many (the tiled products) beside experts of a few, and
experts chosen by none; in a bfloat16 model, experts of many rows in bfloat16 where the
CPU has AVX512-BF16; the weights take the file's bytes (Q4_0: 20 of its 18 a block)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gateway.models.kernels.cpu.library import load
from gateway.models.kernels.cpu.moe_quant import ExpertsWeight
from gateway.models.layers.gguf_quant import StackedExperts
from gateway.models.layers.moe import gathered_linear
from tests.models.gguf_weights import BLOCK_KEPT, quantize_blocks

pytestmark = pytest.mark.isa  # the CPU's instruction set decides the paths

Q = gguf.GGMLQuantizationType
EXPERT_TYPES = [Q.Q4_0, Q.Q4_1, *BLOCK_KEPT]
# Relative to the output's largest value: only the order of the sums differs.
TOLERANCE = 1e-5


def stacked_experts(qtype: Q, experts: int, rows: int, cols: int,
                    seed: int = 0) -> StackedExperts:
    """A random stack [experts, rows, cols] quantized as `qtype` (gguf-py's quantizer for
    Q4_0, Q4_1 and Q8_0, tests/models/gguf_weights.py's for the block types)."""
    values = np.random.default_rng(seed).standard_normal((experts * rows, cols),
                                                         dtype=np.float32)
    raw = gguf.quants.quantize(values, qtype) if qtype in (Q.Q4_0, Q.Q4_1) \
        else quantize_blocks(values, qtype)
    stack = StackedExperts.from_gguf(raw.reshape(-1), qtype, (experts, rows, cols))
    assert stack is not None
    return stack


@pytest.mark.parametrize("qtype", EXPERT_TYPES)
@pytest.mark.parametrize("counts", [[1, 0, 1, 0, 0, 1], [0, 3, 1, 0, 2, 0],
                                    [9, 0, 1, 20, 0, 4]])
def test_the_grouped_product_equals_torch_on_the_dequantized_stack(
        qtype: Q, counts: list[int]) -> None:
    library = load()
    assert library is not None, "the float32 kernels did not build here (see the log)"
    stack = stacked_experts(qtype, len(counts), 72, 512)  # 72 rows: a part chunk of 8
    weight = ExpertsWeight(stack, library)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    row_experts = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    rows = torch.randn(sum(counts), 512, generator=torch.Generator().manual_seed(3))
    dense = stack.dequantize()
    expected = gathered_linear(rows.double(), dense.double(), row_experts).float()
    out = torch.full((rows.shape[0], 80), float("nan"))  # columns 72.. stay untouched
    y = weight.matmul(rows, offsets, out=out[:, :72])
    assert (y - expected).abs().max() < TOLERANCE * expected.abs().max()
    assert out[:, 72:].isnan().all()
    held = weight.num_bytes() / stack.num_bytes()
    assert held == (20 / 18 if qtype == Q.Q4_0 else 1.0)


@pytest.mark.parametrize("qtype", EXPERT_TYPES)
def test_in_a_bfloat16_model_experts_of_many_rows_multiply_in_bfloat16(qtype: Q) -> None:
    """Where the CPU has AVX512-BF16 (and the AVX-512 rows are allowed), an expert of 8 rows
    or more is multiplied as a bfloat16 model multiplies its dequantized weights: rows and
    weights rounded to bfloat16, sums in float32; experts of fewer rows, and every expert
    elsewhere, stay float32 from the codes."""
    library = load()
    assert library is not None
    counts = [9, 0, 1, 20, 0, 4]
    stack = stacked_experts(qtype, len(counts), 72, 512, seed=1)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    row_experts = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    rows = torch.randn(sum(counts), 512, generator=torch.Generator().manual_seed(4))
    dense = stack.dequantize()
    exact = gathered_linear(rows.double(), dense.double(), row_experts)
    rounded = gathered_linear(rows.bfloat16().double(), dense.bfloat16().double(), row_experts)
    many = torch.tensor(counts).index_select(0, row_experts) >= 8
    wide = bool(library.gw_bf16_products())
    expected = torch.where(many.unsqueeze(1) & wide, rounded, exact).float()
    y = ExpertsWeight(stack, library).matmul(rows, offsets, bfloat16=True)
    assert (y - expected).abs().max() < TOLERANCE * expected.abs().max()


def test_offsets_that_do_not_cover_the_rows_are_refused() -> None:
    library = load()
    assert library is not None
    weight = ExpertsWeight(stacked_experts(Q.Q8_0, 2, 8, 64), library)
    with pytest.raises(ValueError, match="offsets must be the int32 ends of 2 experts"):
        weight.matmul(torch.randn(3, 64), torch.tensor([1, 2], dtype=torch.int32))
