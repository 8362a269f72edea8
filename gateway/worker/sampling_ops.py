"""Vectorised sampling arithmetic for the worker's sampler: truncation thresholds and the
inverse-CDF draw.

Top-k, top-p and min-p all keep, per row, the tokens whose logit reaches a threshold, so
they reduce to one threshold per row and one mask. Nothing sorts a whole row (a sort of
a 49,152-token row is slow on CPUs): top-k takes the top k (and applies top-p among them);
top-p alone finds its cut from a histogram of the row's probability mass, sorting only the
few tokens of the bin where p is reached; where reading a value back would stall the device
(a GPU), top-p sorts the rows instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gateway.models.kernels.cpu import sampling as cpu_sampling
from gateway.worker.host_buffers import to_device

# Top-p bins each row's logits by distance below its best, over this span.
_NUM_BINS = 4096
_BINNED_SPAN = 40.0
_NEG_INF = float("-inf")


def truncation_thresholds(logits: torch.Tensor, top_k: list[int | None], top_p: list[float],
                          min_p: list[float]) -> torch.Tensor | None:
    """Per row, the lowest logit kept by top-k, then top-p (over the top-k distribution),
    then min-p: [n, 1]; None when no row truncates.

    logits: [n, vocab], already divided by the temperature. A token whose logit ties the
    threshold is kept, so a tie can keep more than k tokens.
    """
    vocab = logits.shape[1]
    ks = np.array([k if k is not None and k < vocab else vocab for k in top_k], dtype=np.int64)
    ps, min_ps = np.array(top_p, dtype=np.float32), np.array(min_p, dtype=np.float32)
    return row_thresholds(logits, Truncation(
        ks, ps, min_ps, *(to_device(a, logits.device) for a in (ks, ps, min_ps))))


@dataclass
class Truncation:
    """The rows' top-k (vocab: none), top-p and min-p, as host arrays (which decide what
    work a step does, at no cost) and as device tensors of the same values (its operands)."""

    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    top_k_tensor: torch.Tensor
    top_p_tensor: torch.Tensor
    min_p_tensor: torch.Tensor


def row_thresholds(logits: torch.Tensor, rows: Truncation, host_reads: bool = True,
                   ) -> torch.Tensor | None:
    """`truncation_thresholds` of rows whose parameters are given as `Truncation`.

    host_reads False: read nothing back from the device (top-p alone sorts the rows, the
    way a GPU does it best, instead of the CPU's histogram, which reads a width)."""
    num_rows, vocab = logits.shape
    has_k = rows.top_k < vocab
    k_rows = np.flatnonzero(has_k)
    p_rows = np.flatnonzero(~has_k & (rows.top_p < 1.0))
    has_min_p = bool((rows.min_p > 0.0).any())
    if not len(k_rows) and not len(p_rows) and not has_min_p:
        return None
    thresholds = torch.full((num_rows,), _NEG_INF, device=logits.device)
    if len(k_rows):
        index = _index(k_rows, num_rows, logits.device)
        thresholds[index] = _top_k_thresholds(
            logits[index], rows.top_k_tensor[index], int(rows.top_k[k_rows].max()),
            rows.top_p_tensor[index], bool((rows.top_p[k_rows] >= 1.0).all()))
    if len(p_rows):
        index = _index(p_rows, num_rows, logits.device)
        top_p = _top_p_thresholds if host_reads else _top_p_by_sorting
        thresholds[index] = top_p(logits[index], rows.top_p_tensor[index])
    if has_min_p:
        # p_i >= min_p * p_max  <=>  logit_i >= max_logit + log(min_p)  (log 0 = -inf)
        thresholds = torch.maximum(thresholds, logits.amax(-1) + rows.min_p_tensor.log())
    return thresholds.unsqueeze(1)


def _top_k_thresholds(logits: torch.Tensor, k: torch.Tensor, max_k: int, p: torch.Tensor,
                      no_top_p: bool) -> torch.Tensor:
    """[m] thresholds of rows with a top-k, and a top-p over their top k (p = 1: none)."""
    values = logits.topk(max_k, -1).values  # [m, K], descending
    in_top_k = torch.arange(values.shape[1], device=logits.device) < k.unsqueeze(1)
    k_threshold = values.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
    if no_top_p:
        return k_threshold
    norm = values.masked_fill(~in_top_k, _NEG_INF).logsumexp(-1, keepdim=True)
    probs = (values - norm).exp() * in_top_k
    p_threshold = _nucleus_threshold(values, probs, torch.zeros_like(p), p)
    return torch.maximum(k_threshold, torch.where(p < 1.0, p_threshold, _NEG_INF))


def _top_p_by_sorting(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """[m] exact top-p thresholds over whole sorted rows (no value read back)."""
    values = logits.sort(-1, descending=True).values
    weights = (values - values[:, :1]).exp()  # unnormalised probabilities, the best one is 1
    return _nucleus_threshold(values, weights, torch.zeros_like(p),
                              p * weights.sum(-1))


def _top_p_thresholds(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """[m] exact top-p thresholds over whole rows, without sorting them.

    The probability mass is binned by distance below the row's best logit; the cumulative
    mass over the bins finds the bin where p is reached, and only that bin's tokens are
    sorted, instead of a full sort of the row (docs/cpu-performance.md).
    """
    best = logits.amax(-1, keepdim=True)
    bad = ~torch.isfinite(best)  # -inf or NaN rows: any threshold, they cannot sample
    if bad.any():
        logits, best = logits.masked_fill(bad, 0.0), best.masked_fill(bad, 0.0)
    gap = best - logits  # >= 0; inf for a -inf token
    weights = gap.neg().exp_()  # unnormalised probabilities, the best one is 1
    target = p.unsqueeze(1) * weights.sum(-1, keepdim=True)  # p in the weights' units
    # each token's bin (-inf: the last); via int32, much faster than a direct int64 cast
    bins = gap.mul_(_NUM_BINS / _BINNED_SPAN).clamp_(max=_NUM_BINS - 1).int().long()
    mass = torch.zeros(len(logits), _NUM_BINS, device=logits.device)
    cumulative = mass.scatter_add_(1, bins, weights).cumsum_(-1)
    boundary = (cumulative < target).sum(-1).clamp_(max=_NUM_BINS - 1)
    before = cumulative.gather(1, (boundary - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    before = torch.where(boundary > 0, before, 0.0)
    in_boundary = bins == boundary.unsqueeze(1)
    width = int(in_boundary.sum(-1, dtype=torch.int32).max().clamp(min=1))
    values = torch.where(in_boundary, logits, _NEG_INF).topk(width, -1).values
    return _nucleus_threshold(values, (values - best).exp(), before, target.squeeze(1))


def _nucleus_threshold(values: torch.Tensor, probs: torch.Tensor, mass_before: torch.Tensor,
                       p: torch.Tensor) -> torch.Tensor:
    """Given candidate logits `values` [m, K] in descending order, their probabilities and
    the probability of the tokens above them, the last logit of the smallest prefix whose
    probability reaches p: a token stays while the mass before it is below p."""
    cumulative = mass_before.unsqueeze(1) + probs.cumsum(-1)
    num_kept = (cumulative - probs < p.unsqueeze(1)).sum(-1).clamp(min=1)
    return values.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1)


def _index(rows: np.ndarray, num_rows: int, device: torch.device) -> torch.Tensor | slice:
    """Rows `rows` (ascending) of a [num_rows, ...] tensor: all of them as a slice (a view)."""
    return slice(None) if len(rows) == num_rows else to_device(rows, device)


def draw(logits: torch.Tensor, thresholds: torch.Tensor | None,
         uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row by inverting the CDF at `uniforms` ([n] in [0, 1)).

    logits: [n, vocab] (temperature applied); thresholds: [n, 1] or None. Returns the
    tokens [n] and whether each row could be sampled [n] (False: every token is masked,
    or the row holds NaN). One uniform per row keeps a seeded row independent of the
    others: its token depends only on its own logits and its own draw.

    On a CPU the gateway's kernel does it in one call (cpu_sampling.draw: two reads of
    each row, no temporaries; the same tokens up to the last bit of exp); elsewhere torch's
    ops below.
    """
    fast = cpu_sampling.draw(logits, thresholds, uniforms)
    return fast if fast is not None else draw_with_torch(logits, thresholds, uniforms)


def draw_with_torch(logits: torch.Tensor, thresholds: torch.Tensor | None,
                    uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw` through torch's ops (any device)."""
    weights = (logits - logits.amax(-1, keepdim=True)).exp_()
    if thresholds is not None:
        weights.masked_fill_(logits < thresholds, 0.0)
    cumulative = weights.cumsum_(-1)
    total = cumulative[:, -1:]
    # u * total < total, so the chosen token has weight > 0, even when u * total rounds up.
    target = torch.minimum(uniforms.unsqueeze(1) * total,
                           total.nextafter(torch.zeros_like(total)))
    tokens = torch.searchsorted(cumulative, target, right=True).squeeze(1)
    is_ok = torch.isfinite(total.squeeze(1)) & (total.squeeze(1) > 0)
    return tokens.clamp_(max=logits.shape[1] - 1), is_ok
