"""The C kernels for the elementwise steps of a many-row step (elementwise.c: the residual
add with the RMS norm after it, silu(gate) * up, the rotary embedding), against the torch
ops they replace: bit for bit in bfloat16 (on the AVX2 rows and, where the CPU has
AVX512_BF16, on the AVX-512 ones too), to float32 rounding in float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gateway.models.kernels.cpu.elementwise import add_rms_norm, rotary_, silu_mul
from gateway.models.layers.norm import RMSNorm
from tests.models.kernels.cpu.wide_rows import wide_bf16_rows

pytestmark = pytest.mark.isa  # the CPU's instruction set decides the paths

ROWS = (1, 7, 160)  # 160 rows of the default model's widths are split between threads


def _torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[1], eps)
    norm.weight.data = weight
    return norm(x)


def _paths():
    """(dtype, wide) pairs this CPU runs: float32, bfloat16 on AVX2, and bfloat16 on
    AVX-512 where it has AVX512_BF16."""
    with wide_bf16_rows(True) as wide:
        pass
    return [(torch.float32, False), (torch.bfloat16, False)] + \
        ([(torch.bfloat16, True)] if wide else [])


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_and_norm_equal_torchs_add_then_norm(rows, with_delta):
    for dtype, wide in _paths():
        torch.manual_seed(rows)
        x = (torch.randn(rows, 576) * 3).to(dtype)
        delta = torch.randn(rows, 576).to(dtype) if with_delta else None
        weight = torch.randn(576).to(dtype)
        want_x = x.clone() if delta is None else x.clone().add_(delta)
        want = _torch_norm(want_x, weight, 1e-5)
        with wide_bf16_rows(wide):
            out = add_rms_norm(x, delta, weight, 1e-5)
        assert out is not None
        assert torch.equal(x, want_x)  # the residual stream, summed in place
        _check(out, want)


@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_equals_torchs_silu_then_mul(rows):
    for dtype, wide in _paths():
        torch.manual_seed(rows)
        gate_up = (torch.randn(rows, 2 * 1536) * 4).to(dtype)
        want = F.silu(gate_up[:, :1536]).mul_(gate_up[:, 1536:])
        with wide_bf16_rows(wide):
            out = silu_mul(gate_up)
        assert out is not None
        _check(out, want)


@pytest.mark.parametrize("rows", ROWS)
def test_rotary_equals_torchs_and_leaves_the_rest_of_the_row(rows):
    for dtype, wide in _paths():
        torch.manual_seed(rows)
        qkv = torch.randn(rows, 960).to(dtype)  # q (9 heads), k (3), v (3) of 64
        cos, sin = torch.randn(rows, 1, 64).to(dtype), torch.randn(rows, 1, 64).to(dtype)
        want = qkv.clone()
        rotated = want[:, :768].view(rows, -1, 64)
        swapped = rotated.roll(32, -1)
        rotated.mul_(cos).addcmul_(swapped, sin)
        got = qkv.clone()
        with wide_bf16_rows(wide):
            assert rotary_(got[:, :768].view(rows, -1, 64), cos, sin)
        _check(got, want)
        assert torch.equal(got[:, 768:], qkv[:, 768:])


def test_shapes_the_kernels_do_not_take_are_refused_untouched():
    x = torch.randn(4, 20)  # 20 values a row: not a multiple of 8
    before = x.clone()
    assert add_rms_norm(x, torch.ones(4, 20), torch.ones(20), 1e-5) is None
    assert torch.equal(x, before)
    assert add_rms_norm(torch.randn(4, 64).half(), None, torch.ones(64).half(),
                                1e-5) is None
    assert add_rms_norm(torch.randn(64, 4).t(), None, torch.ones(64), 1e-5) is None
    assert silu_mul(torch.randn(3, 2 * 12)) is None
    partial = torch.randn(2, 3, 64)[..., :32]  # a partial rotary dim: heads not contiguous
    assert not rotary_(partial, torch.ones(2, 1, 32), torch.ones(2, 1, 32))
    odd = torch.randn(2, 3, 24)
    odd_before = odd.clone()
    assert not rotary_(odd, torch.ones(2, 1, 24), torch.ones(2, 1, 24))
    assert torch.equal(odd, odd_before)
