"""Engine liveness (API-server process): is the engine core making progress?

The engine core's heartbeat thread sends its completed-step counter twice a second
(`EngineHeartbeat`). The engine is *stalled* when requests are pending (in flight here, or
held by the engine core as its last heartbeat said: with several API servers, one with no
request of its own still sees the others' wait) and no step completed for
`stall_threshold_s`: the core is frozen (no heartbeat: SIGSTOP, a swapped-out host) or
stuck (the counter does not move: a stopped tensor-parallel worker, a hung collective).
Then /health answers 503 and one WARNING is logged; in-flight requests keep waiting, since
a stall can end, but those that arrived since the last step get their queue deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.logger import init_logger
from gateway.messages import EngineHeartbeat

logger = init_logger(__name__)

DEFAULT_STALL_THRESHOLD_S = 30.0
#: Heartbeats (two a second) that must come with the counter standing still for the core to
#: count as alive but stuck; fewer: its process is stopped or frozen.
ALIVE_AFTER_BEATS = 2


class EngineLiveness:
    """Tracks the engine core's progress from its heartbeats and output batches; `check()`
    (called about four times per threshold) decides whether it is stalled."""

    def __init__(self, num_pending: Callable[[], int],
                 stall_threshold_s: float = DEFAULT_STALL_THRESHOLD_S) -> None:
        self.num_pending = num_pending
        self.stall_threshold_s = stall_threshold_s
        self.num_steps = 0
        #: The requests the engine core held at its last heartbeat or batch of outputs
        #: (the engine client sets it from the batch's scheduler stats): every front end's.
        self.num_engine_requests = 0
        #: Set by the engine client: called at each check while requests are pending, with
        #: the time of the last completed step; refuses those that arrived since and are past
        #: their queue deadline, and returns how many others arrived since.
        self.expire_waiting: Callable[[float], int] = lambda progress_at: 0
        self.stalled_reason: str | None = None
        self.num_stalls = 0
        now = time.monotonic()
        self._heartbeat_at = now
        self._progress_at = now
        self._beats_since_progress = 0
        self._stalled_at: float | None = None

    @property
    def is_stalled(self) -> bool:
        return self.stalled_reason is not None

    @property
    def check_interval_s(self) -> float:
        return min(1.0, self.stall_threshold_s / 4)

    def on_heartbeat(self, beat: EngineHeartbeat) -> None:
        self._heartbeat_at = time.monotonic()
        self.num_engine_requests = beat.num_unfinished_requests
        if beat.num_steps != self.num_steps:
            self.num_steps = beat.num_steps
            self.on_progress()
        else:
            self._beats_since_progress += 1

    def on_progress(self) -> None:
        """A step completed (its outputs arrived, or the counter moved)."""
        self._progress_at = time.monotonic()
        self._beats_since_progress = 0
        if self.stalled_reason is not None:
            self._recover("engine steps resumed")

    def check(self) -> None:
        num_arrived = self.expire_waiting(self._progress_at) if self.num_pending() else 0
        now = time.monotonic()
        pending = max(self.num_pending(), self.num_engine_requests)
        if not pending:  # nothing to do is not a stall; time starts when work arrives
            self._progress_at = now
            self._beats_since_progress = 0
            if self.stalled_reason is not None:
                self._recover("no request is pending any more")
            return
        idle = now - self._progress_at
        if idle < self.stall_threshold_s:
            return
        silent = now - self._heartbeat_at
        if self._beats_since_progress < ALIVE_AFTER_BEATS:
            why = (f"the engine core sent no heartbeat for {silent:.1f} s: its process is "
                   "stopped or frozen")
        else:
            why = (f"the engine core is alive but stuck at step {self.num_steps} (a stopped "
                   "or hung worker, or a collective that does not complete)")
        reason = (f"no engine step completed for {idle:.1f} s with {pending} requests pending "
                  f"({num_arrived} of them arrived since); {why}")
        if self.stalled_reason is None:
            self._stalled_at = self._progress_at
            self.num_stalls += 1
            logger.warning("Engine stalled: %s. /health answers 503 until steps resume; "
                           "the requests in flight keep waiting.", reason)
        self.stalled_reason = reason

    def _recover(self, why: str) -> None:
        lasted = time.monotonic() - (self._stalled_at or time.monotonic())
        logger.info("Engine stall over after %.1f s (%s); /health answers 200 again.",
                    lasted, why)
        self.stalled_reason = None
        self._stalled_at = None
