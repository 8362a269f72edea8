"""The persistent batch (worker process): the requests the worker holds, one per row.

Rows 0..n-1 stay filled between steps: finished requests leave, new ones take the lowest
free rows, and the batch is condensed by moving the last rows down into any holes left.
Each step's changes are reported as a `BatchUpdate` (removed, added, moved), the shape
the sampler and logits-processor plugins keep their per-row state with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gateway.messages import SchedulerOutput
from gateway.plugins.contracts import BatchUpdate, MoveDirectionality
from gateway.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int]  # the worker's own list: grows in place as tokens are sampled
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Prompt + output tokens [start, end)."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]


class InputBatch:
    """Rows of requests plus their block tables (numpy [rows, max blocks] int64)."""

    def __init__(self, max_blocks_per_request: int, initial_rows: int = 64) -> None:
        self.row_req_ids: list[str | None] = []
        self.req_id_to_row: dict[str, int] = {}
        self.requests: dict[str, CachedRequestState] = {}
        self.block_table = np.zeros((initial_rows, max_blocks_per_request), dtype=np.int64)
        self.num_blocks = np.zeros(initial_rows, dtype=np.int64)

    @property
    def num_rows(self) -> int:
        return len(self.row_req_ids)

    def update(self, scheduler_output: SchedulerOutput) -> BatchUpdate | None:
        """Apply the step's removals, additions and block changes; condense the rows.

        Returns the BatchUpdate (None when the rows did not change).
        """
        # A new request already held (re-sent without a finish) starts over too.
        leaving = [*scheduler_output.finished_req_ids,
                   *(new.req_id for new in scheduler_output.scheduled_new_reqs)]
        removed = [self._remove(req_id) for req_id in dict.fromkeys(leaving)
                   if req_id in self.req_id_to_row]
        free_rows = sorted(removed)
        added = []
        for new in scheduler_output.scheduled_new_reqs:
            state = CachedRequestState(new.req_id, list(new.prompt_token_ids),
                                       new.sampling_params, list(new.output_token_ids),
                                       new.num_computed_tokens)
            row = free_rows.pop(0) if free_rows else self.num_rows
            self._place(state, row)
            self._set_blocks(row, new.block_ids, replace=True)
            added.append((row, state.sampling_params, state.prompt_token_ids,
                          state.output_token_ids))
        for cached in scheduler_output.scheduled_cached_reqs:
            row = self.req_id_to_row[cached.req_id]
            self.requests[cached.req_id].num_computed_tokens = cached.num_computed_tokens
            if cached.num_blocks is not None:  # blocks of rejected drafts were released
                self.num_blocks[row] = cached.num_blocks - len(cached.new_block_ids)
            self._set_blocks(row, cached.new_block_ids, replace=False)
        moved = self._condense()
        if not (removed or added or moved):
            return None
        return BatchUpdate(batch_size=self.num_rows, added=added, removed=removed, moved=moved)

    # ------------------------------------------------------------------ rows
    def _remove(self, req_id: str) -> int:
        row = self.req_id_to_row.pop(req_id)
        del self.requests[req_id]
        self.row_req_ids[row] = None
        self.num_blocks[row] = 0
        return row

    def _place(self, state: CachedRequestState, row: int) -> None:
        if row == self.num_rows:
            self.row_req_ids.append(None)
            self._ensure_rows(row + 1)
        self.row_req_ids[row] = state.req_id
        self.req_id_to_row[state.req_id] = row
        self.requests[state.req_id] = state

    def _condense(self) -> list[tuple[int, int, MoveDirectionality]]:
        """Move the last rows into holes until rows 0..n-1 are all filled."""
        moved = []
        self._trim()
        while None in self.row_req_ids:
            hole, last = self.row_req_ids.index(None), len(self.row_req_ids) - 1
            req_id = self.row_req_ids.pop()  # not None: the rows are trimmed
            assert req_id is not None
            self.row_req_ids[hole], self.req_id_to_row[req_id] = req_id, hole
            self.block_table[hole] = self.block_table[last]
            self.num_blocks[hole] = self.num_blocks[last]
            moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
            self._trim()
        return moved

    def _trim(self) -> None:
        while self.row_req_ids and self.row_req_ids[-1] is None:
            self.row_req_ids.pop()

    # ------------------------------------------------------------------ block tables
    def _ensure_rows(self, rows: int) -> None:
        if rows > self.block_table.shape[0]:
            grown = max(rows, 2 * self.block_table.shape[0])
            self.block_table = _resize(self.block_table, grown, self.block_table.shape[1])
            self.num_blocks = np.concatenate(
                [self.num_blocks, np.zeros(grown - len(self.num_blocks), dtype=np.int64)])

    def _set_blocks(self, row: int, block_ids: list[int], replace: bool) -> None:
        start = 0 if replace else int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            self.block_table = _resize(self.block_table, self.block_table.shape[0],
                                       max(end, 2 * self.block_table.shape[1]))
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end


def _resize(table: np.ndarray, rows: int, cols: int) -> np.ndarray:
    grown = np.zeros((rows, cols), dtype=table.dtype)
    grown[:table.shape[0], :table.shape[1]] = table
    return grown
