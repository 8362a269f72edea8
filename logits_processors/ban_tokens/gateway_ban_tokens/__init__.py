"""A batch-level logits processor: the token ids a request lists in
`vllm_xargs: {"banned_token_ids": [...]}` get a logit of -inf, so they are never sampled.

Loaded in each worker when its sampler is built (with CUDA hidden during the import: make
no tensors at module level); `validate_params` runs in the engine core for each new request,
so a bad list is an HTTP 400 before the request is scheduled. docs/plugins.md,
"vllm.logits_processors", describes each method.
"""

from __future__ import annotations

from typing import Any

import torch

from gateway.plugins import BatchUpdate, LogitsProcessor, MoveDirectionality, SamplingParams

KEY = "banned_token_ids"


def _banned(params: SamplingParams) -> list[int] | None:
    return (params.extra_args or {}).get(KEY)


class BanTokensLogitsProcessor(LogitsProcessor):
    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(config, device, is_pin_memory)
        self.banned: dict[int, list[int]] = {}  # batch row -> its banned token ids

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        banned = _banned(sampling_params)
        if banned is None:
            return
        if not isinstance(banned, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in banned):
            raise ValueError(f"{KEY} must be a list of non-negative token ids, got {banned!r}")

    def is_argmax_invariant(self) -> bool:
        return False  # banning the top token changes a greedy answer

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for row in batch_update.removed:
            self.banned.pop(row, None)
        for row, params, _prompt_ids, _output_ids in batch_update.added:
            self.banned.pop(row, None)
            if _banned(params):
                self.banned[row] = list(_banned(params) or [])
        for source, target, direction in batch_update.moved:
            moving, other = self.banned.pop(source, None), self.banned.pop(target, None)
            if moving is not None:
                self.banned[target] = moving
            if direction is MoveDirectionality.SWAP and other is not None:
                self.banned[source] = other

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # logits: [batch_size, vocab_size]
        for row, token_ids in self.banned.items():
            ids = [t for t in token_ids if t < logits.shape[1]]
            if ids:
                logits[row, ids] = float("-inf")
        return logits
