"""Which data-parallel engine takes the next request (front-end process), vLLM's way.

Every engine reports its load with each batch of outputs it sends (SchedulerStats: waiting,
running, KV-cache usage). An engine's score is 4 x waiting + running, as in vLLM: a waiting
request will cost a whole first-token latency, a running one only a share of each step.
Requests sent to an engine since its last report count as waiting (they are queued there,
unseen by the report). Ties go to the engine with the lower KV-cache usage, then in turn
from the engine after the last one chosen, so an idle server alternates.

Torch-free and socket-free: the data-parallel engine client feeds it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.messages import SchedulerStats

WAITING_WEIGHT = 4  # vLLM's: one waiting request weighs as four running ones


@dataclass
class EngineLoad:
    """One engine's load as this front end knows it."""

    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    num_unreported: int = 0  # requests sent to it since its last report

    @property
    def score(self) -> int:
        return WAITING_WEIGHT * (self.num_waiting + self.num_unreported) + self.num_running


class LoadBalancer:
    def __init__(self, num_engines: int) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be at least 1, got {num_engines}")
        self.loads = [EngineLoad() for _ in range(num_engines)]
        self._next = 0  # where the search for ties starts
        #: Requests each engine was given, since start (for the logs and the benchmark).
        self.num_chosen = [0] * num_engines

    def choose(self, num_requests: int = 1) -> int:
        """The index of the engine for the next `num_requests` requests (a fan-out's go
        to one engine), counted as sent to it."""
        num_engines = len(self.loads)
        order = [(self._next + offset) % num_engines for offset in range(num_engines)]
        index = min(order, key=lambda i: (self.loads[i].score, self.loads[i].kv_cache_usage))
        self.loads[index].num_unreported += num_requests
        self.num_chosen[index] += num_requests
        self._next = (index + 1) % num_engines
        return index

    def report(self, index: int, stats: SchedulerStats) -> None:
        """Engine `index` says how loaded it is now (with a batch of outputs)."""
        load = self.loads[index]
        load.num_waiting = stats.num_waiting_reqs
        load.num_running = stats.num_running_reqs
        load.kv_cache_usage = stats.kv_cache_usage
        load.num_unreported = 0
