"""The event-loop watchdog of the API server (API-server process): which request blocked
every other one? One `async` handler that blocks (a `time.sleep`, a CPU-bound loop, a
synchronous HTTP call) freezes every stream of the server; the watchdog names it in one
WARNING (route, plugin, request id, the line and the duration) and counts it
(docs/reliability.md). The cost while nothing stalls: a few timer wake-ups and thread
polls a second, and one dictionary entry per request.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.frontend.http.middleware import request_id_of

_current_scope: contextvars.ContextVar[Scope | None] = contextvars.ContextVar(
    "gateway_request_scope", default=None)


@dataclass
class Stall:
    """One stall of the event loop: how long, and what ran meanwhile (None: unknown)."""

    duration_s: float
    scope: Scope | None  # the request's ASGI scope (after routing: its route)
    location: str | None  # "file:line in function" of the innermost frame

    @property
    def request_id(self) -> str | None:
        return request_id_of(self.scope) if self.scope is not None else None


class RequestTracker:
    """Which request each asyncio task works for (weakly: a finished task drops out)."""

    def __init__(self) -> None:
        self._scopes: weakref.WeakKeyDictionary[asyncio.Task[Any], Scope] = \
            weakref.WeakKeyDictionary()
        self._previous_factory: Any = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Tie every task created while a request runs to that request."""
        self._previous_factory = loop.get_task_factory()
        loop.set_task_factory(self._make_task)  # type: ignore[arg-type]

    def enter(self, scope: Scope) -> None:
        _current_scope.set(scope)
        task = asyncio.current_task()
        if task is not None:
            self._scopes[task] = scope

    def scope_of(self, task: asyncio.Task[Any] | None) -> Scope | None:
        return None if task is None else self._scopes.get(task)

    def _make_task(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any],
                   **kwargs: Any) -> asyncio.Task[Any]:
        if self._previous_factory is not None:
            task = self._previous_factory(loop, coro, **kwargs)
        else:
            task = asyncio.Task(coro, loop=loop, **kwargs)
        scope = _current_scope.get()
        if scope is not None:
            self._scopes[task] = scope
        return task


class TrackRequestsMiddleware:
    """Ties the request's task (and the tasks it creates) to its scope for the watchdog."""

    def __init__(self, app: ASGIApp, tracker: RequestTracker) -> None:
        self.app = app
        self.tracker = tracker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.tracker.enter(scope)
        await self.app(scope, receive, send)


class LoopWatchdog:
    """The timer task and the observing thread.

    - The timer task wakes every `threshold / 5` and measures how late it woke (the lag).
    - A daemon thread sees when the timer has not run for longer than the threshold, and notes
      the asyncio task the loop is running then, and the line it is on; the request behind the
      task comes from the `RequestTracker` (`TrackRequestsMiddleware` ties to a request its own
      task and every task created under it, a streaming body's included, via a task factory).
    - When the loop wakes, a lag over the threshold is one stall: `on_stall(Stall)`.
    """

    def __init__(self, threshold_s: float, tracker: RequestTracker,
                 on_stall: Callable[[Stall], None]) -> None:
        self.threshold_s = threshold_s
        self.tick_s = max(0.01, threshold_s / 5)
        self.tracker = tracker
        self.on_stall = on_stall
        self._last_tick = time.monotonic()
        self._seen: tuple[Scope | None, str | None] | None = None  # during the stall
        self._stopped = threading.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._last_tick = time.monotonic()
        self._task = loop.create_task(self._tick())
        thread_id = threading.get_ident()
        threading.Thread(target=self._observe, args=(loop, thread_id), daemon=True,
                         name="gateway-loop-watchdog").start()

    def stop(self) -> None:
        self._stopped.set()
        if self._task is not None:
            self._task.cancel()

    async def _tick(self) -> None:
        while True:
            before = time.monotonic()
            self._last_tick = before
            await asyncio.sleep(self.tick_s)
            lag = time.monotonic() - before - self.tick_s
            seen, self._seen = self._seen, None
            if lag > self.threshold_s:
                scope, location = seen if seen is not None else (None, None)
                self.on_stall(Stall(lag, scope, location))

    def _observe(self, loop: asyncio.AbstractEventLoop, loop_thread_id: int) -> None:
        """In the thread: note what the loop runs once the timer is late past the
        threshold (once per stall)."""
        while not self._stopped.wait(self.tick_s):
            late = time.monotonic() - self._last_tick - self.tick_s
            if late > self.threshold_s and self._seen is None:
                task = asyncio.current_task(loop)
                self._seen = (self.tracker.scope_of(task), _location(loop_thread_id))


def _location(thread_id: int) -> str | None:
    """Where that thread is now: the innermost frame's file, line and function."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return None
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
