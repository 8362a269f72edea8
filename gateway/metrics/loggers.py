"""The built-in logging stat logger: one line per interval (API-server process).

    Engine 000: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.0
    tokens/s, Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit
    rate: 42.0%

The prefix cache hit rate is vLLM's (`CachingMetrics`; 0.0 while prefix caching is off).
With speculative decoding, a second line after an interval that verified drafts (vLLM's).
An idle engine logs at DEBUG, so a quiet server does not fill its log. Off with
`--disable-log-stats`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from gateway.logger import init_logger
from gateway.messages import (
    IterationStats,
    PrefixCacheStats,
    SchedulerStats,
    SpecDecodingStats,
)
from gateway.plugins import StatLoggerBase

logger = init_logger("gateway.metrics")


class CachingMetrics:
    """The prefix cache hit rate, vLLM's: cached tokens over queried tokens, over the most recent
    `max_recent_requests` requests (so it moves with the workload rather than settling).
    """

    def __init__(self, max_recent_requests: int = 1000) -> None:
        self.max_recent_requests = max_recent_requests
        self._window: deque[PrefixCacheStats] = deque()
        self.num_requests = self.num_queries = self.num_hits = 0

    def observe(self, stats: PrefixCacheStats) -> None:
        if not stats.requests:
            return
        self._window.append(stats)
        self._add(stats, 1)
        # Drop the oldest while the rest still cover the window.
        while self.num_requests - self._window[0].requests >= self.max_recent_requests:
            self._add(self._window.popleft(), -1)

    def _add(self, stats: PrefixCacheStats, sign: int) -> None:
        self.num_requests += sign * stats.requests
        self.num_queries += sign * stats.queries
        self.num_hits += sign * stats.hits

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0


class SpecDecodingLogging:
    """vLLM's speculative-decoding line: drafts verified over one logging interval."""

    def __init__(self) -> None:
        self.stats = SpecDecodingStats()

    def observe(self, stats: SpecDecodingStats) -> None:
        total = self.stats
        total.num_drafts += stats.num_drafts
        total.num_draft_tokens += stats.num_draft_tokens
        total.num_accepted_tokens += stats.num_accepted_tokens
        per_pos = total.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(stats.num_accepted_tokens_per_pos) - len(per_pos)))
        for position, count in enumerate(stats.num_accepted_tokens_per_pos):
            per_pos[position] += count

    def log(self, level: int, elapsed: float) -> None:
        stats, self.stats = self.stats, SpecDecodingStats()
        if not stats.num_drafts:
            return
        per_pos = ", ".join(f"{count / stats.num_drafts:.3f}"
                            for count in stats.num_accepted_tokens_per_pos)
        logger.log(level, "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted "
                   "throughput: %.2f tokens/s, Drafted throughput: %.2f tokens/s, Accepted: "
                   "%d tokens, Drafted: %d tokens, Per-position acceptance rate: %s, Avg "
                   "Draft acceptance rate: %.1f%%",
                   1 + stats.num_accepted_tokens / stats.num_drafts,
                   stats.num_accepted_tokens / elapsed, stats.num_draft_tokens / elapsed,
                   stats.num_accepted_tokens, stats.num_draft_tokens, per_pos,
                   100 * stats.num_accepted_tokens / max(stats.num_draft_tokens, 1))


class LoggingStatLogger(StatLoggerBase):
    def __init__(self, config: Any, engine_index: int = 0) -> None:
        super().__init__(config, engine_index)
        self.last_scheduler_stats: SchedulerStats | None = None
        self.was_busy = False
        self.prefix_caching = CachingMetrics()
        self.spec_decoding = SpecDecodingLogging()
        self._start_interval(time.monotonic())

    def _start_interval(self, now: float) -> None:
        self.interval_start = now
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None, engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.last_scheduler_stats = scheduler_stats
            if scheduler_stats.prefix_cache_stats is not None:
                self.prefix_caching.observe(scheduler_stats.prefix_cache_stats)
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens
            if iteration_stats.spec_decoding_stats is not None:
                self.spec_decoding.observe(iteration_stats.spec_decoding_stats)

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self.interval_start, 1e-9)
        prompt_rate = self.num_prompt_tokens / elapsed
        generation_rate = self.num_generation_tokens / elapsed
        busy = bool(self.num_prompt_tokens or self.num_generation_tokens)
        # One INFO line after activity (including the interval that went idle), DEBUG after.
        level = logging.INFO if busy or self.was_busy else logging.DEBUG
        self.was_busy = busy
        self._start_interval(now)
        stats = self.last_scheduler_stats
        logger.log(level, "Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation "
                   "throughput: %.1f tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache "
                   "usage: %.1f%%, Prefix cache hit rate: %.1f%%", self.engine_index,
                   prompt_rate, generation_rate,
                   stats.num_running_reqs if stats else 0,
                   stats.num_waiting_reqs if stats else 0,
                   100 * stats.kv_cache_usage if stats else 0.0,
                   100 * self.prefix_caching.hit_rate)
        self.spec_decoding.log(level, elapsed)

    def log_engine_initialized(self) -> None:
        """Nothing to add: the engine client logs the engine's capacity at its handshake."""
