"""Truncation thresholds and the inverse-CDF draw, against a plain sort-based reference
(the draw's CPU kernel against torch's ops: tests/models/kernels/cpu/test_sampling.py)."""

from __future__ import annotations

import pytest
import torch

from gateway.worker.sampling_ops import draw, draw_with_torch, truncation_thresholds

pytestmark = pytest.mark.isa  # the CPU's instruction set decides the paths

# The draw's two ways: the gateway's CPU kernel (what `draw` runs on a CPU) and torch's ops
# (every other device); each test of the draw runs both.
DRAWS = {"kernel": draw, "torch": draw_with_torch}


def reference_kept(row: torch.Tensor, top_k: int | None, top_p: float,
                   min_p: float) -> set[int]:
    """The kept tokens, the slow way: full sort, float64, top-k then top-p then min-p."""
    values, order = row.double().sort(descending=True)
    keep = len(values) if top_k is None else min(top_k, len(values))
    probs = values[:keep].softmax(-1)
    before = probs.cumsum(-1) - probs
    keep = int((before < top_p).sum()) if top_p < 1.0 else keep
    full = row.double().softmax(-1)
    return {int(t) for t in order[:keep] if full[t] >= min_p * full.max() and full[t] > 0}


def kept_by_thresholds(logits: torch.Tensor, top_k, top_p, min_p) -> list[set[int]]:
    thresholds = truncation_thresholds(logits, top_k, top_p, min_p)
    assert thresholds is not None
    mask = (logits >= thresholds) & (logits > float("-inf"))
    return [set(torch.nonzero(row).flatten().tolist()) for row in mask]


CASES = [  # (top_k, top_p, min_p)
    (None, 0.9, 0.0), (50, 1.0, 0.0), (None, 0.5, 0.0), (10, 0.8, 0.0), (None, 1.0, 0.05),
    (300, 0.95, 0.0), (None, 0.99, 0.01), (1, 1.0, 0.0), (5000, 0.3, 0.0), (None, 1.0, 0.0),
    (None, 0.999, 0.0), (None, 0.2, 0.0),
]
SLACK = 1e-5  # float32 sums differ from float64 ones near the cut


@pytest.mark.parametrize("scale", [8.0, 1.0, 0.01])  # peaked, LLM-like, nearly flat
def test_thresholds_keep_the_same_tokens_as_a_full_sort(scale):
    # Flat rows need thousands of tokens for their nucleus: the wide (histogram) path.
    logits = torch.randn(len(CASES), 5000, generator=torch.Generator().manual_seed(0)) * scale
    logits[::3, :700] = float("-inf")  # tokens masked by min_tokens or a processor
    top_k, top_p, min_p = (list(column) for column in zip(*CASES))

    kept = kept_by_thresholds(logits, top_k, top_p, min_p)

    for row, (k, p, m), got in zip(logits, CASES, kept):
        p_slack, m_slack = SLACK * (p < 1.0), SLACK * (m > 0.0)
        least = reference_kept(row, k, p - p_slack, m + m_slack)
        most = reference_kept(row, k, p + p_slack, m - m_slack)
        assert least <= got <= most, (k, p, m)
        assert len(most) - len(least) <= 10  # the slack hides no wrong cut


def test_tied_logits_are_all_kept():
    logits = torch.zeros(2, 3000)

    kept = kept_by_thresholds(logits, [5, None], [1.0, 0.5], [0.0, 0.0])

    assert kept == [set(range(3000))] * 2


def test_no_truncation_gives_no_thresholds():
    assert truncation_thresholds(torch.randn(3, 10), [None, 10, 99], [1.0] * 3,
                                 [0.0] * 3) is None


@pytest.mark.parametrize("way", DRAWS)
def test_draw_never_picks_a_masked_or_zero_weight_token(way: str):
    logits = torch.tensor([[0.0, -1e30, 0.0, 5.0, float("-inf")]] * 4)
    thresholds = torch.tensor([[-1.0]] * 4)  # keeps tokens 0, 2 and 3
    logits[:, 3] = -2.0  # ... but 3 is below the threshold
    uniforms = torch.tensor([0.0, 0.3, 0.7, 1.0 - 2 ** -24])

    tokens, is_ok = DRAWS[way](logits, thresholds, uniforms)

    assert tokens.tolist() == [0, 0, 2, 2]
    assert is_ok.all()


@pytest.mark.parametrize("way", DRAWS)
def test_draw_inverts_the_cdf(way: str):
    logits = torch.tensor([0.25, 0.5, 0.25]).log().repeat(4, 1)

    tokens, _ = DRAWS[way](logits, None, torch.tensor([0.1, 0.3, 0.6, 0.9]))

    assert tokens.tolist() == [0, 1, 1, 2]


@pytest.mark.parametrize("way", DRAWS)
def test_draw_reports_rows_that_cannot_be_sampled(way: str):
    logits = torch.zeros(3, 4)
    logits[1] = float("-inf")
    logits[2, 0] = float("nan")

    tokens, is_ok = DRAWS[way](logits, None, torch.full((3,), 0.5))

    assert is_ok.tolist() == [True, False, False]
    assert ((tokens >= 0) & (tokens < 4)).all()
