"""Verifying draft tokens (worker process): exact rejection sampling over one target step.

Each row with k drafts has k + 1 target distributions, one per query position. N-gram
drafts are one-hot, so speculative sampling reduces to: accept draft d with probability
p(d); at the first rejection, sample from p with d removed (the residual), else a bonus
token from the last position. Greedy rows: accept while the argmax equals the draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class DraftLayout:
    """Where each row's positions sit in the flat [T, vocab] rows, T = sum(k_i + 1)."""

    num_drafts: np.ndarray  # [R] int64: k_i, at least 1
    draft_token_ids: np.ndarray  # [sum k_i] int64, row by row

    @property
    def num_positions(self) -> int:
        return int(self.num_drafts.sum()) + len(self.num_drafts)

    @property
    def first_position(self) -> np.ndarray:
        """[R]: each row's first flat position."""
        counts = self.num_drafts + 1
        return np.cumsum(counts) - counts

    def draft_positions(self) -> np.ndarray:
        """[sum k_i]: the flat position whose distribution judges each draft."""
        return np.repeat(self.first_position, self.num_drafts) + ranks(self.num_drafts)


def target_probabilities(logits: torch.Tensor, temperature: torch.Tensor,
                         thresholds: torch.Tensor | None) -> torch.Tensor:
    """[T, vocab] logits -> the processed distribution: divided by `temperature` ([T, 1]),
    tokens below `thresholds` ([T, 1]: top-k, top-p, min-p) removed, softmax."""
    scaled = logits / temperature
    if thresholds is not None:
        scaled = scaled.masked_fill(scaled < thresholds, float("-inf"))
    return scaled.softmax(-1)


def verify(layout: DraftLayout, argmax: torch.Tensor, probs: torch.Tensor | None,
           is_greedy: np.ndarray, uniforms: torch.Tensor) -> list[list[int]]:
    """Each row's tokens this step: its accepted drafts, then one target token, so they
    follow the target distribution exactly (Leviathan et al. 2023; Chen et al. 2023).
    Every row's positions are worked on at once, and read back once.

    argmax: [T] the target's best token at each position (what greedy rows follow);
    probs: [T, vocab] the processed distributions (None when every row is greedy);
    is_greedy: [R]; uniforms: [2, T] in [0, 1), one to accept and one to resample.
    """
    device = argmax.device
    drafts = torch.from_numpy(layout.draft_token_ids).to(device)
    judged = torch.from_numpy(layout.draft_positions()).to(device)
    accepted = argmax[judged] == drafts  # [sum k]: greedy's rule
    fallback = argmax.clone()  # [T]: the target token at each position, if it is needed
    sampled_rows = np.flatnonzero(~is_greedy)
    if len(sampled_rows):
        assert probs is not None
        accepted, fallback = _sample_rows(layout, sampled_rows, probs, drafts, judged,
                                          accepted, fallback, uniforms)
    values = torch.cat([accepted.to(torch.int64), fallback]).tolist()
    return _assemble(layout, values)


def _sample_rows(layout: DraftLayout, rows: np.ndarray, probs: torch.Tensor,
                 drafts: torch.Tensor, judged: torch.Tensor, accepted: torch.Tensor,
                 fallback: torch.Tensor, uniforms: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled rows' acceptances and target tokens, into greedy's tensors."""
    device = probs.device
    row_of_draft = np.repeat(np.arange(len(layout.num_drafts)), layout.num_drafts)
    row_of_position = np.repeat(np.arange(len(layout.num_drafts)), layout.num_drafts + 1)
    draft_sel = torch.from_numpy(np.flatnonzero(np.isin(row_of_draft, rows))).to(device)
    position_sel = torch.from_numpy(np.flatnonzero(np.isin(row_of_position, rows))).to(device)
    # Accept draft d at position j with probability p_j(d).
    p_draft = probs[judged[draft_sel], drafts[draft_sel]]
    accepted[draft_sel] = uniforms[0, judged[draft_sel]] < p_draft
    # The residual at each judged position: p with its draft removed; elsewhere (the
    # bonus position) p itself.
    residual = probs[position_sel].clone()
    removed = torch.zeros(len(probs), dtype=torch.bool, device=device)
    removed[judged] = True
    draft_at = torch.zeros(len(probs), dtype=torch.int64, device=device)
    draft_at[judged] = drafts
    remove_rows = removed[position_sel]
    residual[remove_rows.nonzero().squeeze(1), draft_at[position_sel][remove_rows]] = 0.0
    fallback[position_sel] = _inverse_cdf(residual, uniforms[1, position_sel])
    return accepted, fallback


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of non-negative `weights` [n, vocab] (unnormalised), at `uniforms`
    [n]; a row of zeros (its draft held all the mass, so it is never needed) gives 0."""
    cumulative = weights.cumsum(-1)
    total = cumulative[:, -1:]
    target = torch.minimum(uniforms.unsqueeze(1) * total,
                           total.nextafter(torch.zeros_like(total)))
    tokens = torch.searchsorted(cumulative, target, right=True).squeeze(1)
    return tokens.clamp_(max=weights.shape[1] - 1)


def _assemble(layout: DraftLayout, values: list[int]) -> list[list[int]]:
    """Per row: drafts while accepted, then the target token at the first rejection (or
    the bonus token after the last draft)."""
    num_judged = len(layout.draft_token_ids)
    accepted, fallback = values[:num_judged], values[num_judged:]
    drafts = layout.draft_token_ids.tolist()
    tokens, draft_index = [], 0
    for row_first, k in zip(layout.first_position.tolist(), layout.num_drafts.tolist()):
        row_accepted = accepted[draft_index:draft_index + k]
        num_accepted = row_accepted.index(0) if 0 in row_accepted else k
        tokens.append(drafts[draft_index:draft_index + num_accepted]
                      + [fallback[row_first + num_accepted]])
        draft_index += k
    return tokens


def ranks(counts: np.ndarray) -> np.ndarray:
    """0..c-1 for each count c, concatenated."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
