"""The responses kept for `previous_response_id` and `GET /v1/responses/{id}` (front end):
in this API-server process's memory, bounded in count (the oldest goes first) and in age
(--responses-store-max-entries, --responses-store-max-age). Nothing survives a restart,
and with several API servers each keeps its own.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_ENTRIES = 1000
DEFAULT_MAX_AGE_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    #: The conversation before this response's answer, as chat messages, without the
    #: instructions (a later response does not inherit them, as in OpenAI's API).
    messages: list[dict[str, Any]]
    #: The response object as it was answered.
    response: dict[str, Any]
    stored_at: float


class ResponseStore:
    """Responses by id; `max_entries` 0 keeps none."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_age_s: float = DEFAULT_MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.max_age_s, self.clock = max_entries, max_age_s, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, messages: list[dict[str, Any]],
            response: dict[str, Any]) -> None:
        self._entries.pop(response_id, None)
        self._entries[response_id] = StoredResponse(messages, response, self.clock())
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        self._expire()

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def _expire(self) -> None:
        oldest = self.clock() - self.max_age_s
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.stored_at > oldest:
                break
            self._entries.popitem(last=False)
