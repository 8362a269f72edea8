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

import numpy as np
import torch

from gateway.messages import TokenLogprobs
from gateway.worker.host_buffers import to_device

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
    rows = (logits if len(positions) == len(logits)
            else logits[to_device(np.array(positions, dtype=np.int64), logits.device)])
    return torch.log_softmax(rows.float(), dim=-1)


def gather_on_device(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]
                     ) -> torch.Tensor:
    """logprobs [m, vocab], token_ids [m] (on the same device): per row the token, its
    logprob and rank, then the top max(num_top) logprobs and their ids, packed as one
    float64 [m * (3 + 2 * max(num_top))] tensor (ids and ranks are exact in float64), to
    be read back with the step's other results and handed to `unpack`."""
    ids = token_ids.unsqueeze(1)
    chosen = logprobs.gather(1, ids)  # [m, 1]
    ranks = (logprobs > chosen).sum(-1, keepdim=True) + 1
    parts = [ids, chosen, ranks]
    if max(num_top, default=0):
        top = logprobs.topk(max(num_top), dim=-1)
        parts += [top.values, top.indices]
    return torch.cat([part.double() for part in parts], 1).flatten()


def unpack(values: Sequence[float], num_top: Sequence[int]) -> list[TokenLogprobs]:
    """`gather_on_device`'s values, read back, as one TokenLogprobs per row."""
    k = max(num_top, default=0)
    width = 3 + 2 * k
    entries = []
    for i, n in enumerate(num_top):
        row = values[i * width:(i + 1) * width]
        entries.append(TokenLogprobs([int(row[0])] + [int(t) for t in row[3 + k:3 + k + n]],
                                     [row[1], *row[3:3 + n]], int(row[2])))
    return entries


def gather(logprobs: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
           ) -> list[TokenLogprobs]:
    """logprobs [m, vocab]; per row the chosen token's logprob and rank, then the top
    `num_top[i]` tokens. One transfer to Python for the whole batch."""
    ids = to_device(np.array(list(token_ids), dtype=np.int64), logprobs.device)
    return unpack(gather_on_device(logprobs, ids, num_top).tolist(), num_top)


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
