"""Iteration stats, measured in the engine core while it steps.

The scheduler calls the collector as requests are scheduled, sample tokens and finish;
`take()` hands over what one step did as an `IterationStats`, which the engine core sends
inside that step's `EngineCoreOutputs` (no second channel). Times are `time.time()`, the
clock of the front end's arrival times (one machine).
"""

from __future__ import annotations

import time

from gateway.engine.request import Request
from gateway.messages import FinishedRequestStats, IterationStats, SpecDecodingStats


class IterationStatsCollector:
    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.time_to_first_tokens: list[float] = []
        self.inter_token_latencies: list[float] = []
        self.finished: list[FinishedRequestStats] = []
        self.spec_decoding: SpecDecodingStats | None = None

    def on_scheduled(self, request: Request, now: float) -> None:
        if request.scheduled_time is None:
            request.scheduled_time = now

    def on_token(self, request: Request, now: float, num_tokens: int = 1) -> None:
        """`num_tokens` tokens (several: accepted drafts) were sampled for `request` in the
        step that ended at `now`."""
        self.num_generation_tokens += num_tokens
        if request.first_token_time is None:
            request.first_token_time = now
            self.num_prompt_tokens += len(request.prompt_token_ids)
            self.time_to_first_tokens.append(now - request.arrival_time)
        elif request.last_token_time is not None:
            self.inter_token_latencies.append(now - request.last_token_time)
        request.last_token_time = now

    def on_drafts_verified(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if self.spec_decoding is None:
            self.spec_decoding = SpecDecodingStats()
        self.spec_decoding.observe(num_draft_tokens, num_accepted_tokens)

    def on_pooled(self, request: Request) -> None:
        """A pooling request computed its prompt (it has no tokens to sample)."""
        self.num_prompt_tokens += len(request.prompt_token_ids)

    def on_finished(self, request: Request, reason: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        scheduled = request.scheduled_time if request.scheduled_time is not None else now
        first_token = request.first_token_time
        self.finished.append(FinishedRequestStats(
            request_id=request.request_id, finish_reason=reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_generation_tokens=len(request.output_token_ids),
            e2e_latency=now - request.arrival_time,
            queued_time=scheduled - request.arrival_time,
            prefill_time=0.0 if first_token is None else first_token - scheduled,
            decode_time=0.0 if first_token is None else now - first_token,
            inference_time=now - scheduled,
            max_tokens_param=request.sampling_params.max_tokens))

    def take(self) -> IterationStats | None:
        """What happened since the last call (None when nothing did), and start afresh."""
        if not self.num_generation_tokens and not self.finished:
            return None
        stats = IterationStats(self.num_prompt_tokens, self.num_generation_tokens,
                               self.time_to_first_tokens, self.inter_token_latencies,
                               self.finished, spec_decoding_stats=self.spec_decoding)
        self._reset()
        return stats
