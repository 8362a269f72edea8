"""Which engine requests are the choices of one client request (vLLM's parallel sampling).

Front-end process. A request with `n` > 1 runs as `n` engine requests, one per choice; the
engine core sees only single samples. vLLM's `vllm:request_params_n` is observed once per
client request (per prompt of a batch), with its `n`, when its last choice finishes; a
request the front end did not fan out counts as n = 1. `ParentRequests` turns each step's
finished engine requests into those values (`IterationStats.n_params_iter`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from gateway.messages import FinishedRequestStats

#: Choices whose finish is still awaited, at most: a choice that was never sent (its
#: request failed before) is forgotten, oldest first, once this many are waiting.
MAX_PENDING_CHOICES = 100_000


@dataclass
class _Parent:
    n: int
    num_unfinished: int


class ParentRequests:
    def __init__(self, max_pending: int = MAX_PENDING_CHOICES) -> None:
        self.max_pending = max_pending
        self._parent_of: OrderedDict[str, _Parent] = OrderedDict()

    def add(self, choice_request_ids: list[str]) -> None:
        """The engine requests of one client request's `n` choices (n > 1)."""
        if len(choice_request_ids) < 2:
            return
        parent = _Parent(len(choice_request_ids), len(choice_request_ids))
        for request_id in choice_request_ids:
            self._parent_of[request_id] = parent
        while len(self._parent_of) > self.max_pending:
            self._parent_of.popitem(last=False)

    def n_params(self, finished: list[FinishedRequestStats]) -> list[int]:
        """One `n` per client request whose last engine request is among `finished`."""
        values = []
        for stats in finished:
            parent = self._parent_of.pop(stats.request_id, None)
            if parent is None:
                values.append(1)
                continue
            parent.num_unfinished -= 1
            if parent.num_unfinished == 0:
                values.append(parent.n)
        return values
