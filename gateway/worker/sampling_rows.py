"""The sampler's per-request state, one entry per persistent-batch row (worker process).

Kept in step with the model runner's persistent batch through the same `BatchUpdate`s the
logits processors receive: removed, then added, then moved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gateway.plugins.contracts import BatchUpdate, MoveDirectionality
from gateway.sampling_params import SamplingParams

_SEED_MASK = (1 << 64) - 1  # torch generators take seeds in [0, 2**64)


@dataclass(slots=True)
class RequestRow:
    params: SamplingParams
    #: The runner's own list: it grows in place as the request generates.
    output_token_ids: list[int]
    #: A seeded sampled request draws from its own CPU generator, one number per step, so
    #: its tokens do not depend on the rest of the batch. None: the shared generator.
    generator: torch.Generator | None
    bias_token_ids: list[int]
    bias_values: list[float]
    #: EOS and stop token ids, masked while fewer than `min_tokens` tokens are out.
    min_tokens_blocked: list[int]
    #: A parameter this worker cannot honour; every step of the request fails with it.
    error: str | None = None
    #: The prompt (for the repetition penalty).
    prompt_token_ids: list[int] | None = None
    #: [vocab] bool, True for the allowed_token_ids; None: every token is allowed.
    allowed_mask: torch.Tensor | None = None

    @property
    def is_greedy(self) -> bool:
        return self.params.temperature == 0.0

    @property
    def is_below_min_tokens(self) -> bool:
        return len(self.output_token_ids) < self.params.min_tokens


def make_row(params: SamplingParams, output_token_ids: list[int], vocab_size: int,
             eos_token_ids: list[int], prompt_token_ids: list[int] | None = None
             ) -> RequestRow:
    bias = params.logit_bias or {}
    kept = {t: b for t, b in bias.items() if 0 <= t < vocab_size}
    bad = [t for t in bias if t not in kept]
    error = (f"logit_bias names token id {bad[0]}, outside the vocabulary "
             f"[0, {vocab_size})") if bad else None
    blocked = [t for t in dict.fromkeys([*eos_token_ids, *params.stop_token_ids])
               if 0 <= t < vocab_size]
    generator = _generator(params, len(output_token_ids))
    allowed = [t for t in params.allowed_token_ids or [] if 0 <= t < vocab_size]
    if params.allowed_token_ids is not None and not allowed:
        error = error or "allowed_token_ids holds no token id of the vocabulary"
    mask = None
    if allowed:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[allowed] = True
    bad_ids = [t for words in params.bad_words_token_ids for t in words
               if not 0 <= t < vocab_size]
    if bad_ids:
        error = error or f"bad_words tokenize to id {bad_ids[0]}, outside the vocabulary"
    return RequestRow(params, output_token_ids, generator, list(kept), list(kept.values()),
                      blocked, error, prompt_token_ids or [], mask)


def _generator(params: SamplingParams, num_done: int) -> torch.Generator | None:
    if params.seed is None or params.temperature == 0.0:
        return None
    generator = torch.Generator().manual_seed(params.seed & _SEED_MASK)
    if num_done:
        # A request re-added after preemption: skip the draws of the tokens it already
        # has, so it continues exactly as it would have without the preemption.
        torch.rand(num_done, generator=generator)
    return generator


class BatchRows:
    """Row index -> RequestRow, for the rows of the persistent batch."""

    def __init__(self, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.batch_size = 0
        self._rows: list[RequestRow | None] = []

    def apply(self, update: BatchUpdate) -> None:
        for row in update.removed:
            if row < len(self._rows):
                self._rows[row] = None
        for row, params, prompt_token_ids, output_token_ids in update.added:
            self._grow(row + 1)
            self._rows[row] = make_row(params, output_token_ids, self.vocab_size,
                                       self.eos_token_ids, prompt_token_ids)
        for source, target, direction in update.moved:
            self._grow(max(source, target) + 1)
            if direction is MoveDirectionality.SWAP:
                self._rows[source], self._rows[target] = self._rows[target], self._rows[source]
            else:
                self._rows[target], self._rows[source] = self._rows[source], None
        self.batch_size = update.batch_size
        self._grow(update.batch_size)

    def get(self, row: int) -> RequestRow:
        entry = self._rows[row] if 0 <= row < self.batch_size else None
        if entry is None:
            raise ValueError(f"row {row} of the persistent batch holds no request "
                             f"(batch size {self.batch_size}); was its BatchUpdate applied?")
        return entry

    def _grow(self, size: int) -> None:
        if size > len(self._rows):
            self._rows.extend([None] * (size - len(self._rows)))
