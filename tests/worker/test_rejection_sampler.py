"""Rejection sampling of n-gram drafts: greedy follows the argmax exactly, and sampled
tokens follow the target's processed distribution (checked statistically)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gateway.worker.rejection_sampler import DraftLayout, target_probabilities, verify

NUM_ROWS = 40_000


def _layout(num_drafts: list[int], drafts: list[int]) -> DraftLayout:
    return DraftLayout(np.array(num_drafts, dtype=np.int64), np.array(drafts, dtype=np.int64))


def test_greedy_accepts_while_the_argmax_matches_then_takes_the_argmax():
    # Row 0: drafts 3, 1, 2 against argmax 3, 1, 4, 0: two accepted, then 4.
    # Row 1: drafts 5, 6 against argmax 5, 6, 7: all accepted, bonus 7.
    # Row 2: draft 9 against argmax 8, 2: rejected at once, 8.
    layout = _layout([3, 2, 1], [3, 1, 2, 5, 6, 9])
    argmax = torch.tensor([3, 1, 4, 0, 5, 6, 7, 8, 2])
    tokens = verify(layout, argmax, None, np.ones(3, dtype=bool), torch.rand(2, 9))
    assert tokens == [[3, 1, 4], [5, 6, 7], [8]]


def _total_variation(samples: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=len(probs)) / len(samples)
    return 0.5 * float(np.abs(counts - probs).sum())


@pytest.mark.parametrize("draft", [0, 2, 4])  # a likely, a middling and an unlikely draft
def test_sampled_tokens_follow_the_target_distribution(draft):
    generator = torch.Generator().manual_seed(draft)
    logits0 = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -0.5])
    logits1 = torch.tensor([-1.0, 0.0, 1.5, 0.3, 0.2, 1.0])
    temperature = torch.full((2 * NUM_ROWS, 1), 0.8)
    logits = torch.stack([logits0, logits1]).repeat(NUM_ROWS, 1)
    probs = target_probabilities(logits, temperature, None)
    layout = _layout([1] * NUM_ROWS, [draft] * NUM_ROWS)
    tokens = verify(layout, probs.argmax(-1), probs, np.zeros(NUM_ROWS, dtype=bool),
                    torch.rand(2, 2 * NUM_ROWS, generator=generator))
    first = np.array([row[0] for row in tokens])
    p0, p1 = probs[0].numpy(), probs[1].numpy()
    assert _total_variation(first, p0) < 0.015
    # Where the draft was accepted, the bonus token follows the next position's target.
    bonus = np.array([row[1] for row in tokens if len(row) == 2])
    assert len(bonus) == pytest.approx(NUM_ROWS * p0[draft], rel=0.1)
    if len(bonus) > 2000:
        assert _total_variation(bonus, p1) < 0.03


def test_truncation_is_part_of_the_target_distribution():
    """A draft outside top-k is never accepted; the tokens follow the truncated target."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(2 * NUM_ROWS, 1)
    scaled = logits.clone()
    thresholds = scaled.topk(2, -1).values[:, -1:]  # top-k 2
    probs = target_probabilities(logits, torch.ones(2 * NUM_ROWS, 1), thresholds)
    layout = _layout([1] * NUM_ROWS, [3] * NUM_ROWS)
    tokens = verify(layout, probs.argmax(-1), probs, np.zeros(NUM_ROWS, dtype=bool),
                    torch.rand(2, 2 * NUM_ROWS, generator=generator))
    assert all(len(row) == 1 for row in tokens)
    first = np.array([row[0] for row in tokens])
    assert _total_variation(first, probs[0].numpy()) < 0.015
    assert set(first.tolist()) <= {0, 1}


def test_greedy_and_sampled_rows_verify_in_one_call():
    layout = _layout([2, 1], [1, 1, 0])
    logits = torch.full((5, 3), -30.0)
    logits[[0, 1, 2, 3, 4], [1, 1, 2, 0, 2]] = 30.0  # near one-hot targets
    probs = target_probabilities(logits, torch.ones(5, 1), None)
    tokens = verify(layout, logits.argmax(-1), probs, np.array([True, False]),
                    torch.rand(2, 5))
    assert tokens == [[1, 1, 2], [0, 2]]
