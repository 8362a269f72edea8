"""Log-probabilities in the worker process.

They come from the model's raw distribution, before logit_bias, penalties, temperature or
truncation change it (vLLM's default, `raw_logprobs`), and are computed only for the rows
that asked: a step in which no request wants them does no extra work. Sampled tokens get
theirs from the step's logits; prompt tokens from the hidden states of the prefill, in
chunks so that a long prompt never holds [prompt, vocab] logits at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from gateway.messages import TokenLogprobs

# Prompt positions whose logits are materialised at once ([chunk, vocab] float32).
_PROMPT_CHUNK = 256


class ScheduledRequest(Protocol):
    """What the prompt collector needs of one request scheduled this step."""

    @property
    def state(self) -> Any: ...  # prompt_token_ids, sampling_params, output_token_ids

    @property
    def start(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


def rows_wanting_logprobs(requests: Sequence[Any]) -> list[int]:
    """Positions (in `requests`, objects with `sampling_params`) that asked for logprobs."""
    return [i for i, req in enumerate(requests) if req.sampling_params.logprobs is not None]


def raw_logprobs(logits: torch.Tensor, positions: list[int]) -> torch.Tensor | None:
    """log_softmax of the rows at `positions` of logits [n, vocab]: [m, vocab], a new tensor
    (the sampler may change `logits` in place afterwards). None when no row asked."""
    if not positions:
        return None
    rows = logits if len(positions) == len(logits) else logits[torch.tensor(positions)]
    return torch.log_softmax(rows.float(), dim=-1)


def gather(logprobs: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
           ) -> list[TokenLogprobs]:
    """logprobs [m, vocab]; per row the chosen token's logprob and rank, then the top
    `num_top[i]` tokens. One transfer to Python for the whole batch."""
    chosen_ids = torch.tensor(list(token_ids), device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, chosen_ids)  # [m, 1]
    ranks = (logprobs > chosen).sum(-1) + 1
    k = max(num_top, default=0)
    if k:
        top = logprobs.topk(k, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    else:
        top_values, top_ids = [[] for _ in token_ids], [[] for _ in token_ids]
    chosen_list, rank_list = chosen.squeeze(1).tolist(), ranks.tolist()
    return [TokenLogprobs([token_id] + ids[:n], [value] + values[:n], rank)
            for token_id, value, rank, ids, values, n
            in zip(token_ids, chosen_list, rank_list, top_ids, top_values, num_top)]


class PromptLogprobs:
    """Collects prompt logprobs chunk by chunk of a (possibly chunked) prefill, and hands
    them over when the request samples its first token."""

    def __init__(self) -> None:
        self._pending: dict[str, list[TokenLogprobs]] = {}

    def collect(self, model: Any, hidden: torch.Tensor,
                scheduled: Sequence[ScheduledRequest]) -> None:
        """hidden [N, E]: the step's hidden states, `scheduled` in their flat order."""
        offset = 0
        for item in scheduled:
            state, start = item.state, item.start
            num_top = state.sampling_params.prompt_logprobs
            # The logits at position p predict prompt token p + 1. A request that already
            # has output (recomputed after a preemption) sent its prompt logprobs before.
            end = min(start + item.num_tokens, len(state.prompt_token_ids) - 1)
            if num_top is not None and not state.output_token_ids and start < end:
                if start == 0:
                    self._pending[state.req_id] = []
                entries = self._pending.setdefault(state.req_id, [])
                for first in range(start, end, _PROMPT_CHUNK):
                    last = min(end, first + _PROMPT_CHUNK)
                    logits = model.compute_logits(hidden[offset + first - start:
                                                         offset + last - start])
                    entries += gather(torch.log_softmax(logits.float(), dim=-1),
                                      state.prompt_token_ids[first + 1:last + 1],
                                      [num_top] * (last - first))
            offset += item.num_tokens

    def take(self, req_id: str) -> list[TokenLogprobs] | None:
        return self._pending.pop(req_id, None)

    def discard(self, req_ids: Sequence[str]) -> None:
        """Forget finished, aborted or preempted requests (a preempted one starts over)."""
        for req_id in req_ids:
            self._pending.pop(req_id, None)
