"""N-gram prompt lookup (engine-core process): draft tokens for speculative decoding.

After each step, a decoding request's latest n tokens (n from prompt_lookup_max down to
prompt_lookup_min) are looked up earlier in its prompt + output; at the first earlier
occurrence of the longest suffix found, the tokens that followed it are proposed (vLLM's
n-gram proposer). Which requests may take drafts at all: `can_speculate`.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from gateway.config import SpeculativeConfig
from gateway.sampling_params import SamplingParams


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_drafts) tokens to follow `token_ids`;
        none when no suffix of min_n tokens or more occurs earlier."""
        num_drafts = min(self.num_speculative_tokens, max_drafts)
        if num_drafts <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # Windows of n tokens that end before the last token (a match needs a
            # continuation), compared with the last n tokens.
            windows = sliding_window_view(tokens[:-1], n)
            matches = (windows == tokens[-n:]).all(axis=1)
            if matches.any():
                start = int(matches.argmax()) + n
                return tokens[start:start + num_drafts].tolist()
        return []


def can_speculate(params: SamplingParams, has_logits_processors: bool) -> bool:
    """Whether a request may verify drafts: what its sampling does to each position must
    depend on that position's logits alone and be built for drafts. Otherwise (logprobs,
    structured outputs, penalties, seeds, min_tokens, bad words, logit bias, allowed ids,
    LoRA, logits processors) it runs one token a step, with the same output."""
    return not (
        has_logits_processors
        or params.logprobs is not None or params.prompt_logprobs is not None
        or params.structured_outputs is not None
        or params.has_penalties or params.seed is not None
        or params.min_tokens > 0 or params.bad_words_token_ids
        or params.logit_bias or params.allowed_token_ids is not None
        or params.lora_request is not None)
