"""The sampler's per-request state, one entry per persistent-batch row (worker process).

Kept in step with the model runner's persistent batch through the same `BatchUpdate`s the
logits processors receive: removed, then added, then moved. Each parameter is a column:
a numpy array on the host, which the sampler reads to choose its work (free), and a
tensor on the device, which its arithmetic reads; the tensors change only when rows do,
except the penalties' token counts and the bad words' recent tokens, which the device
updates itself from each step's sampled tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gateway.plugins.contracts import BatchUpdate, MoveDirectionality
from gateway.sampling_params import SamplingParams
from gateway.worker.seeded_draws import SeededDraws

# The float columns, in the order of `BatchRows.floats`' rows.
FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "repetition", "frequency", "presence")
_BOOL_COLUMNS = ("filled", "greedy", "seeded", "penalties", "repeats", "bias", "allowed",
                 "bad_words", "blocked", "failed")


def check_row(params: SamplingParams, vocab_size: int, eos_token_ids: list[int],
              ) -> tuple[dict[int, float], list[int], str | None]:
    """The request's logit_bias and min_tokens ids within the vocabulary, and the error
    that fails each of its steps (a parameter this worker cannot honour), if any."""
    bias = params.logit_bias or {}
    kept = {t: b for t, b in bias.items() if 0 <= t < vocab_size}
    bad = [t for t in bias if t not in kept]
    error = (f"logit_bias names token id {bad[0]}, outside the vocabulary "
             f"[0, {vocab_size})") if bad else None
    blocked = [t for t in dict.fromkeys([*eos_token_ids, *params.stop_token_ids])
               if 0 <= t < vocab_size]
    allowed = [t for t in params.allowed_token_ids or [] if 0 <= t < vocab_size]
    if params.allowed_token_ids is not None and not allowed:
        error = error or "allowed_token_ids holds no token id of the vocabulary"
    bad_ids = [t for words in params.bad_words_token_ids for t in words
               if not 0 <= t < vocab_size]
    if bad_ids:
        error = error or f"bad_words tokenize to id {bad_ids[0]}, outside the vocabulary"
    return kept, blocked, error


class BatchRows:
    """The rows' sampling parameters as host arrays and device tensors."""

    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: torch.device,
                 to_device: Callable[[np.ndarray], torch.Tensor]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        self._to_device = to_device
        self.batch_size = 0
        self.capacity = 0
        # Host columns (numpy, [capacity]).
        self.bools: dict[str, np.ndarray] = {}
        self.host_floats = np.zeros((len(FLOAT_COLUMNS), 0), dtype=np.float32)
        self.top_k = np.zeros(0, dtype=np.int64)  # vocab_size: no top-k
        self.min_tokens = np.zeros(0, dtype=np.int64)
        self.num_output = np.zeros(0, dtype=np.int64)  # tokens out (min_tokens)
        self.params: list[SamplingParams | None] = []
        self.errors: list[str | None] = []
        self.bias: list[dict[int, float]] = []
        self.blocked_ids: list[list[int]] = []
        self.seeds = SeededDraws()
        # Device tensors, rebuilt from the host columns when `dirty`.
        self.dirty = True
        #: Per flag, whether any row of the batch has it (from `refresh`): a step skips an
        #: option nobody in the batch uses without looking at its rows.
        self.in_batch: dict[str, bool] = {}
        self.floats = torch.zeros(len(FLOAT_COLUMNS), 0, device=device)  # [6, capacity]
        self.top_k_tensor = torch.zeros(0, dtype=torch.int64, device=device)
        self.bias_ids = self.bias_values = self.blocked = torch.zeros(0, 0, device=device)
        # Words [W]: its row, its prefix right-aligned in [W, L] (-1: before the prefix),
        # and its last token. The history holds each row's last L output tokens.
        self.word_rows = np.zeros(0, dtype=np.int64)
        self.word_prefix = torch.zeros(0, 0, dtype=torch.int64, device=device)
        self.word_last = torch.zeros(0, dtype=torch.int64, device=device)
        # Per row [capacity, vocab] tensors, made when a row first needs them.
        self.allowed_mask: torch.Tensor | None = None  # True: may be sampled
        self.counts: torch.Tensor | None = None  # float32: each token's count in the output
        self.prompt_seen: torch.Tensor | None = None  # the prompt's tokens (repetition)
        self.history: torch.Tensor | None = None  # [capacity, L] int64, -1 before the first
        self._grow(0)

    # ------------------------------------------------------------------ batch updates
    def apply(self, update: BatchUpdate) -> None:
        for row in update.removed:
            if row < self.capacity:
                self._clear(row)
        for row, params, prompt_token_ids, output_token_ids in update.added:
            self._grow(row + 1)
            self._add(row, params, prompt_token_ids or [], output_token_ids)
        for source, target, direction in update.moved:
            self._grow(max(source, target) + 1)
            self._move(source, target, direction is MoveDirectionality.SWAP)
        self.batch_size = update.batch_size
        self._grow(update.batch_size)
        self.dirty = True

    def _clear(self, row: int) -> None:
        for column in self.bools.values():
            column[row] = False
        self.params[row] = self.errors[row] = None
        self.bias[row], self.blocked_ids[row] = {}, []

    def _add(self, row: int, params: SamplingParams, prompt: list[int],
             output: list[int]) -> None:
        self._clear(row)
        bias, blocked, error = check_row(params, self.vocab_size, self.eos_token_ids)
        self.params[row], self.errors[row] = params, error
        self.bias[row], self.blocked_ids[row] = bias, blocked
        greedy = params.temperature == 0.0
        values = dict(temperature=params.temperature, top_p=params.top_p, min_p=params.min_p,
                      repetition=params.repetition_penalty,
                      frequency=params.frequency_penalty, presence=params.presence_penalty)
        for i, name in enumerate(FLOAT_COLUMNS):
            self.host_floats[i, row] = values[name]
        top_k = params.top_k
        self.top_k[row] = top_k if top_k is not None and 0 < top_k < self.vocab_size \
            else self.vocab_size
        self.min_tokens[row], self.num_output[row] = params.min_tokens, len(output)
        flags = dict(filled=True, greedy=greedy, seeded=params.seed is not None and not greedy,
                     penalties=params.has_penalties,
                     repeats=params.repetition_penalty != 1.0, bias=bool(bias),
                     allowed=params.allowed_token_ids is not None,
                     bad_words=bool(params.bad_words_token_ids),
                     blocked=bool(blocked) and params.min_tokens > len(output),
                     failed=error is not None)
        for name, value in flags.items():
            self.bools[name][row] = value
        if flags["seeded"]:
            self.seeds.seed(row, params.seed or 0, skip=len(output))
        if flags["allowed"]:
            mask = self._rows_tensor("allowed_mask", torch.bool, True)
            allowed = [t for t in params.allowed_token_ids or [] if 0 <= t < self.vocab_size]
            row_mask = np.zeros(self.vocab_size, dtype=np.bool_)
            row_mask[allowed] = True
            mask[row] = self._to_device(row_mask)
        if params.has_penalties:
            counts = self._rows_tensor("counts", torch.float32, 0)
            counts[row] = self._to_device(_bincount(output, self.vocab_size))
            if flags["repeats"]:
                seen = self._rows_tensor("prompt_seen", torch.bool, False)
                seen[row] = self._to_device(_bincount(prompt, self.vocab_size) > 0)
        if flags["bad_words"]:
            self._set_history(row, output, params)

    def _move(self, source: int, target: int, swap: bool) -> None:
        columns: list[np.ndarray | torch.Tensor] = [
            *self.bools.values(), self.top_k, self.min_tokens, self.num_output]
        columns += [t for t in (self.allowed_mask, self.counts, self.prompt_seen, self.history)
                    if t is not None]
        for column in columns:
            if swap:
                column[[source, target]] = column[[target, source]]  # type: ignore[assignment]
            else:
                column[target] = column[source]
        tables: list[list[Any]] = [self.params, self.errors, self.bias, self.blocked_ids]
        for table in tables:
            if swap:
                table[source], table[target] = table[target], table[source]
            else:
                table[target] = table[source]
        if swap:
            self.host_floats[:, [source, target]] = self.host_floats[:, [target, source]]
        else:
            self.host_floats[:, target] = self.host_floats[:, source]
            self._clear(source)
        self.seeds.move(source, target, swap)

    # ------------------------------------------------------------------ lookups
    def check(self, rows: np.ndarray) -> None:
        """Raise unless every row holds a request."""
        held = (rows >= 0) & (rows < self.batch_size)
        held[held] = self.bools["filled"][rows[held]]
        if not held.all():
            row = int(rows[np.argmin(held)])
            raise ValueError(f"row {row} of the persistent batch holds no request "
                             f"(batch size {self.batch_size}); was its BatchUpdate applied?")

    def flag(self, name: str, rows: np.ndarray) -> np.ndarray:
        return self.bools[name][rows]

    def refresh(self) -> None:
        """Copy the host columns that changed to the device (once per batch change)."""
        if not self.dirty:
            return
        size = max(self.batch_size, 1)
        self.in_batch = {name: bool(column[:self.batch_size].any())
                         for name, column in self.bools.items()}
        self.floats = self._to_device(np.ascontiguousarray(self.host_floats[:, :size]))
        self.top_k_tensor = self._to_device(self.top_k[:size].copy())
        self.bias_ids, self.bias_values = self._padded_table(
            size, "bias", lambda row: list(self.bias[row].items()))
        self.blocked, _ = self._padded_table(
            size, "blocked", lambda row: [(t, 0.0) for t in self.blocked_ids[row]],
            repeat_first=True)
        self._refresh_words(size)
        self.dirty = False

    def _padded_table(self, size: int, flag: str,
                      entry_of: Callable[[int], list[tuple[int, float]]],
                      repeat_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """[size, widest] token ids and values of the rows with `flag` (others: empty);
        padding: token 0 with 0.0 (adds nothing), or the row's first id again (a mask)."""
        entries = {int(row): entry_of(int(row)) for row in np.flatnonzero(self.bools[flag][:size])}
        width = max(map(len, entries.values()), default=0)
        ids = np.zeros((size, width), dtype=np.int64)
        values = np.zeros((size, width), dtype=np.float32)
        for row, entry in entries.items():
            if entry:
                ids[row, :len(entry)] = [t for t, _ in entry]
                values[row, :len(entry)] = [v for _, v in entry]
                if repeat_first:
                    ids[row, len(entry):] = entry[0][0]
        return self._to_device(ids), self._to_device(values)

    def _refresh_words(self, size: int) -> None:
        rows, prefixes, lasts = [], [], []
        width = 0 if self.history is None else self.history.shape[1]
        for row in np.flatnonzero(self.bools["bad_words"][:size]):
            for word in self.params[row].bad_words_token_ids:  # type: ignore[union-attr]
                rows.append(row)
                prefixes.append([-1] * (width - len(word) + 1) + word[:-1])
                lasts.append(word[-1])
        self.word_rows = np.array(rows, dtype=np.int64)
        self.word_prefix = self._to_device(np.array(prefixes, dtype=np.int64).reshape(
            len(rows), width))
        self.word_last = self._to_device(np.array(lasts, dtype=np.int64))

    def _set_history(self, row: int, output: list[int], params: SamplingParams) -> None:
        needed = max(len(word) - 1 for word in params.bad_words_token_ids)
        if self.history is None or self.history.shape[1] < needed:
            old = self.history
            self.history = torch.full((self.capacity, needed), -1, dtype=torch.int64,
                                      device=self.device)
            if old is not None and old.shape[1]:
                self.history[:, needed - old.shape[1]:] = old
        width = self.history.shape[1]
        recent = output[max(0, len(output) - width):] if width else []
        line = np.full(width, -1, dtype=np.int64)
        line[width - len(recent):] = recent
        self.history[row] = self._to_device(line)

    # ------------------------------------------------------------------ storage
    def _rows_tensor(self, name: str, dtype: torch.dtype, fill: bool | int) -> torch.Tensor:
        tensor = getattr(self, name)
        if tensor is None:
            tensor = torch.full((self.capacity, self.vocab_size), fill, dtype=dtype,
                                device=self.device)
            setattr(self, name, tensor)
        return tensor

    def _grow(self, rows: int) -> None:
        if rows <= self.capacity and self.bools:
            return
        old, grown = self.capacity, max(rows, 2 * self.capacity, 8)
        self.capacity = grown
        for name in _BOOL_COLUMNS:
            self.bools[name] = _extend(self.bools.get(name, np.zeros(0, dtype=np.bool_)), grown)
        self.host_floats = np.concatenate(
            [self.host_floats, np.ones((len(FLOAT_COLUMNS), grown - old), dtype=np.float32)], 1)
        self.top_k = _extend(self.top_k, grown)
        self.min_tokens, self.num_output = (_extend(self.min_tokens, grown),
                                            _extend(self.num_output, grown))
        for table, empty in ((self.params, None), (self.errors, None)):
            table.extend([empty] * (grown - old))  # type: ignore[list-item]
        self.bias.extend({} for _ in range(grown - old))
        self.blocked_ids.extend([] for _ in range(grown - old))
        for name, fill in (("allowed_mask", True), ("counts", 0), ("prompt_seen", False),
                           ("history", -1)):
            tensor = getattr(self, name)
            if tensor is not None:
                bigger = tensor.new_full((grown, tensor.shape[1]), fill)
                bigger[:old] = tensor
                setattr(self, name, bigger)
        self.dirty = True


def _extend(column: np.ndarray, size: int) -> np.ndarray:
    grown = np.zeros(size, dtype=column.dtype)
    grown[:len(column)] = column
    return grown


def _bincount(tokens: list[int], vocab_size: int) -> np.ndarray:
    """[vocab_size] float32: each token's count in `tokens`."""
    return np.bincount(np.array(tokens, dtype=np.int64),
                       minlength=vocab_size)[:vocab_size].astype(np.float32)
