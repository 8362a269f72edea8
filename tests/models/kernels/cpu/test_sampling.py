"""The sampler's draw in one C call (sampling.c, through sampling.py) against
`draw_with_torch`, the same draw through torch's ops."""

from __future__ import annotations

import pytest
import torch

from gateway.models.kernels.cpu.sampling import draw
from gateway.worker.sampling_ops import draw_with_torch

pytestmark = pytest.mark.isa  # the CPU's instruction set decides the paths


def test_the_kernel_draws_the_tokens_torchs_ops_draw():
    # 64 rows of a 49,152-token vocabulary (split between threads), some truncated, one
    # with a NaN threshold (keeps everything, as torch's comparison does), a vocabulary
    # that is not a multiple of the kernel's vector or block width.
    generator = torch.Generator().manual_seed(7)
    for vocab in (49152, 1037):
        logits = torch.randn(64, vocab, generator=generator) * 3
        logits[5, ::3] = float("-inf")
        thresholds = logits.topk(40, -1).values[:, -1:].clone()
        thresholds[::2] = float("-inf")
        thresholds[3] = float("nan")
        uniforms = torch.rand(64, generator=generator)
        for limits in (None, thresholds):
            drawn = draw(logits.clone(), limits, uniforms)
            assert drawn is not None
            tokens, is_ok = drawn
            expected, expected_ok = draw_with_torch(logits.clone(), limits, uniforms)
            assert is_ok.all() and expected_ok.all()
            # the same token but where exp's last bit moves a boundary (none of 128 here)
            assert tokens.tolist() == expected.tolist()


def test_the_kernel_leaves_the_logits_and_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, float("-inf"), 0.5]]).repeat(4000, 1)
    before = logits.clone()
    drawn = draw(logits, None, torch.rand(4000, generator=torch.Generator().manual_seed(1)))
    assert drawn is not None
    tokens, is_ok = drawn
    assert torch.equal(logits, before) and is_ok.all()
    counts = torch.bincount(tokens, minlength=5).double() / 4000
    expected = before[0].softmax(-1).double()
    assert counts[3] == 0
    assert (counts - expected).abs().max() < 0.03
