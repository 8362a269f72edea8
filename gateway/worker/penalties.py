"""Penalties and token masks of the sampler, vectorised over the rows that use them
(worker process). Rows without any cost nothing: each function returns at once.

- allowed_token_ids: every other token is masked.
- bad_words: a word's last token is masked when the output ends with the rest of it (a
  one-token word is always masked), vLLM's rule.
- penalties, vLLM's (and OpenAI's) definitions, in vLLM's order: repetition over prompt
  and output (a positive logit divided by it, a negative one multiplied, as transformers'
  RepetitionPenaltyLogitsProcessor), then frequency (times each token's count in the
  output) and presence (once per token the output holds) subtracted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gateway.worker.sampling_rows import RequestRow

_NEG_INF = float("-inf")


def apply_allowed_tokens(logits: torch.Tensor, requests: Sequence[RequestRow]) -> None:
    positions = [i for i, req in enumerate(requests) if req.allowed_mask is not None]
    if not positions:
        return
    masks = torch.stack([requests[i].allowed_mask for i in positions])  # type: ignore[misc]
    index = torch.tensor(positions, device=logits.device)
    logits[index] = logits[index].masked_fill(~masks.to(logits.device), _NEG_INF)


def apply_bad_words(logits: torch.Tensor, requests: Sequence[RequestRow]) -> None:
    positions: list[int] = []
    token_ids: list[int] = []
    for i, req in enumerate(requests):
        output = req.output_token_ids
        for word in req.params.bad_words_token_ids:
            prefix = word[:-1]
            if not prefix or output[len(output) - len(prefix):] == prefix:
                positions.append(i)
                token_ids.append(word[-1])
    if token_ids:
        index = (torch.tensor(positions, device=logits.device),
                 torch.tensor(token_ids, device=logits.device))
        logits.index_put_(index, torch.tensor(_NEG_INF, device=logits.device))


def apply_penalties(logits: torch.Tensor, requests: Sequence[RequestRow]) -> None:
    """logits [n, vocab], changed in place for the rows with a penalty."""
    positions = [i for i, req in enumerate(requests) if req.params.has_penalties]
    if not positions:
        return
    device, vocab = logits.device, logits.shape[1]
    rows = [requests[i] for i in positions]
    index = torch.tensor(positions, device=device)
    selected = logits[index]  # [m, vocab], a copy
    counts = _token_counts([r.output_token_ids for r in rows], vocab, device)
    in_output = counts > 0
    repetition = [r.params.repetition_penalty for r in rows]
    if any(p != 1.0 for p in repetition):
        seen = in_output | (_token_counts([r.prompt_token_ids or [] for r in rows], vocab,
                                          device) > 0)
        penalty = torch.tensor(repetition, device=device).unsqueeze(1)
        penalised = torch.where(selected > 0, selected / penalty, selected * penalty)
        selected = torch.where(seen, penalised, selected)
    frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=device)
    presence = torch.tensor([r.params.presence_penalty for r in rows], device=device)
    selected -= frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * in_output
    logits[index] = selected


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int,
                  device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how often each token occurs in each list."""
    counts = torch.zeros(len(token_lists), vocab, device=device)
    rows = [i for i, tokens in enumerate(token_lists) for _ in tokens]
    if rows:
        flat = [t for tokens in token_lists for t in tokens]
        counts.index_put_((torch.tensor(rows, device=device), torch.tensor(flat, device=device)),
                          torch.ones(len(flat), device=device), accumulate=True)
    return counts
