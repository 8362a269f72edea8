"""Load shedding (API-server process): refuse a request at once rather than queue it for
minutes (docs/reliability.md).

`--max-num-queued-reqs N` (vLLM's name and meaning): at most N requests in flight in the
engine, waiting and running together (a request that fans out, prompts x `n`, counts all
its sequences at once, those still held back included); the one beyond gets
`RequestRejectedError` ("queue_full") before anything is sent to the engine.
`--max-queue-time S` is applied by the engine core's scheduler, and by the engine client
while the core completes no step; both give `RequestRejectedError` ("queue_timeout").
Both are answered 503 with `Retry-After`; a request already admitted is never dropped.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable

RATE_WINDOW_S = 30.0
MAX_RETRY_AFTER_S = 60
UNKNOWN_RATE_RETRY_AFTER_S = 5  # nothing finished lately: no rate to estimate from
REJECTION_REASONS = ("queue_full", "queue_timeout")


def queue_limit(own: float | None, server: float | None) -> tuple[float, str] | None:
    """How long a request may wait, and whose limit that is: the shorter of its own
    `max_queue_time` and the server's `--max-queue-time` (the engine core's rule too)."""
    if own is not None and (server is None or own < server):
        return own, "the request's max_queue_time"
    return None if server is None else (server, "--max-queue-time")


class RequestRejectedError(RuntimeError):
    """The server refused a request for load (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, code: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


class Admission:
    """The in-flight cap, the drain-rate estimate and the refusal counts (by reason). A
    refusal's Retry-After is the seconds the queue ahead needs to drain at the rate requests
    finished over the last `RATE_WINDOW_S` (1 to `MAX_RETRY_AFTER_S`).
    """

    def __init__(self, num_inflight: Callable[[], int],
                 max_num_queued_reqs: int | None = None) -> None:
        self.num_inflight = num_inflight
        self.max_num_queued_reqs = max_num_queued_reqs
        self.num_rejected: Counter[str] = Counter()
        #: Called with the reason of each refusal (the Prometheus counter).
        self.rejection_listeners: list[Callable[[str], None]] = []
        self._finished: deque[tuple[float, int]] = deque()  # (monotonic time, count)

    def check(self, num_requests: int = 1) -> None:
        """Raise RequestRejectedError when `num_requests` more would pass the cap."""
        limit = self.max_num_queued_reqs
        if limit is None:
            return
        inflight = self.num_inflight()
        if inflight + num_requests > limit:
            asked = "" if num_requests == 1 else \
                f" and this request needs {num_requests} (its prompts x n)"
            raise self.reject(
                "queue_full", f"The server has {inflight} requests queued or running{asked}, "
                f"its limit is --max-num-queued-reqs {limit}; retry later.",
                inflight + num_requests - limit)

    def reject(self, code: str, message: str, num_ahead: int) -> RequestRejectedError:
        """Count a refusal and return its error, with a Retry-After for `num_ahead`
        requests to drain."""
        self.num_rejected[code] += 1
        for listener in self.rejection_listeners:
            listener(code)
        return RequestRejectedError(message, code, self.retry_after_s(num_ahead))

    def note_finished(self, count: int) -> None:
        now = time.monotonic()
        self._finished.append((now, count))
        self._trim(now)

    def drain_rate(self) -> float:
        """Requests finished per second over the last `RATE_WINDOW_S` (0.0: none)."""
        now = time.monotonic()
        self._trim(now)
        if not self._finished:
            return 0.0
        span = max(1.0, now - self._finished[0][0])
        return sum(count for _, count in self._finished) / span

    def retry_after_s(self, num_ahead: int) -> int:
        rate = self.drain_rate()
        if rate <= 0.0:
            return UNKNOWN_RATE_RETRY_AFTER_S
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(max(1, num_ahead) / rate)))

    def _trim(self, now: float) -> None:
        while self._finished and now - self._finished[0][0] > RATE_WINDOW_S:
            self._finished.popleft()
