"""The sampler: one token per persistent-batch row each step (worker process).

Each step, in order: allowed_token_ids, bad_words, logit_bias, min_tokens (EOS and stop ids
masked until enough tokens are out), the penalties, the logits-processor plugins, then
greedy argmax or temperature, top-k, top-p, min-p and a draw; `sample()` works in place,
each option over all its rows at once, from the row tensors of sampling_rows. A logits
processor's failure does not escape, and since a processor keeps its own notion
of its rows, it fails every row of the step (raising in `apply()`, returning something
other than a tensor of the batch's shape, or having raised in `update_state()` since the
last `sample()`); the other processors are skipped, and all are called again next step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from gateway.config import ModelConfig
from gateway.logger import init_logger
from gateway.plugins.contracts import BatchUpdate, LogitsProcessor
from gateway.plugins.loader import PluginError
from gateway.plugins.process import process_role
from gateway.worker.host_buffers import to_device
from gateway.worker.logits_processors import (
    class_name,
    load_logits_processor_classes,
    validate_request,
)
from gateway.worker.rejection_sampler import DraftLayout, target_probabilities, verify
from gateway.worker.sampling_ops import Truncation, draw, row_thresholds
from gateway.worker.sampling_rows import FLOAT_COLUMNS, BatchRows
from gateway.worker.seeded_draws import SeededDraws

__all__ = ["Sampler", "load_logits_processor_classes", "validate_request"]

logger = init_logger(__name__)

_NEG_INF = float("-inf")
_TEMPERATURE, _TOP_P, _MIN_P, _REPETITION, _FREQUENCY, _PRESENCE = range(len(FLOAT_COLUMNS))
_UNSAMPLEABLE = "no token can be sampled: every logit is -inf or NaN"


@dataclass
class StepSample:
    """One step's sampling, still on the device: `finish` it with the values read back."""

    rows: list[int]
    tokens: torch.Tensor  # [n] int64
    ok: torch.Tensor  # [n] bool: False where the row could not be sampled
    #: row -> error, known without reading the device (a parameter, a processor failure).
    errors: dict[int, str]

    def finish(self, tokens: list[float], ok: list[float]) -> tuple[list[int], dict[int, str]]:
        """The tokens as ints and {row: error}, given `tokens` and `ok` as read back."""
        errors = self.errors
        for row, row_ok in zip(self.rows, ok):
            if not row_ok:
                errors.setdefault(row, _UNSAMPLEABLE)
        return [int(t) for t in tokens], errors


class Sampler:
    """Built once per worker; `update_state()` then `sample()` every step.

    host_reads (default: on a CPU) lets the arithmetic read values back from the device
    where that is faster; False (a GPU) reads nothing back: `sample_on_device` then leaves
    the device queue running, for the caller's one read of the step."""

    def __init__(self, model_config: ModelConfig, vocab_size: int, eos_token_ids: list[int],
                 device: torch.device, host_reads: bool | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.host_reads = device.type == "cpu" if host_reads is None else host_reads
        self.processor_classes = load_logits_processor_classes(model_config)
        self.processors = [_instantiate(cls, model_config, device)
                           for cls in self.processor_classes]
        # Asked once, as vLLM does: the answer is part of the processor's definition.
        self._greedy_processors = [p for p in self.processors if not p.is_argmax_invariant()]
        self._rows = BatchRows(vocab_size, eos_token_ids, device, self._to_device)
        # Unseeded rows share one stream (seeded from the model config); seeded rows each
        # have their own (seeded_draws: the numbers torch's CPU generators give). All on
        # the host: a draw is one number per row, copied to the device with the step.
        self._shared = SeededDraws()
        self._shared.seed(0, model_config.seed)
        self._batch_buffer: torch.Tensor | None = None
        self._pending_failure: str | None = None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Apply the persistent batch's changes since the last step (None: none) to the
        sampler's rows and forward them to every logits processor. Call before sample()."""
        if batch_update is not None:
            self._rows.apply(batch_update)
        for processor in self.processors:
            try:
                processor.update_state(batch_update)
            except Exception as exc:  # a plugin's bug fails requests, never the worker
                self._pending_failure = self._pending_failure or _failure(
                    processor, "update_state", exc)

    def sample(self, logits: torch.Tensor, rows: list[int]) -> tuple[list[int], dict[int, str]]:
        """logits: [len(rows), vocab_size] for these persistent-batch rows, modified in place.

        Returns the token per row (same order) and {row: error} for rows that failed this
        step; a failed row's token is meaningless and must be dropped. The sampler counts
        each sampled token as appended to its request's output (penalties, min_tokens,
        bad_words and seeds follow it)."""
        step = self.sample_on_device(logits, rows)
        both = torch.stack([step.tokens, step.ok.to(step.tokens.dtype)]).tolist()
        return step.finish(both[0], both[1])

    @torch.inference_mode()
    def sample_on_device(self, logits: torch.Tensor, rows: list[int]) -> StepSample:
        """`sample()` without reading the tokens back (with host_reads False, without
        reading anything back): the caller reads them, with whatever else it needs."""
        self._check_logits(logits, rows)
        index = np.array(rows, dtype=np.int64)
        self._rows.check(index)
        self._rows.refresh()
        step = _Step(index, self._rows.batch_size, self.device)
        logits = logits.float()
        failed = np.flatnonzero(self._rows.flag("failed", index))
        errors = {rows[i]: self._rows.errors[rows[i]] or "" for i in failed}
        self._apply_allowed_tokens(logits, step)
        self._apply_bad_words(logits, step)
        self._apply_logit_bias(logits, step)
        self._apply_min_tokens(logits, step)
        self._apply_penalties(logits, step)
        logits, failure = self._apply_processors(logits, rows, step)
        failure, self._pending_failure = self._pending_failure or failure, None
        tokens, is_ok = self._draw(logits, step)
        if failure is not None:
            errors = dict.fromkeys(rows, failure)
        self._follow(step, tokens, is_ok, failed if failure is None else np.arange(len(rows)))
        return StepSample(list(rows), tokens, is_ok, errors)

    @torch.inference_mode()
    def verify_drafts(self, logits: torch.Tensor, rows: list[int],
                      layout: DraftLayout) -> list[list[int]]:
        """Speculative decoding: each row's accepted drafts and one more token, from
        `logits` [T, vocab] at its k + 1 positions (rejection_sampler.py). Only rows whose
        sampling is temperature, top-k, top-p and min-p come here (the engine core
        proposes drafts for no other), so each position's distribution is the one
        `sample()` would draw from at that position."""
        index = np.array(rows, dtype=np.int64)
        self._rows.check(index)
        self._rows.refresh()
        logits = logits.float()
        argmax = logits.max(-1).indices  # as greedy rows take it in _draw
        is_greedy = self._rows.flag("greedy", index)
        probs = None
        if not is_greedy.all():
            positions = np.repeat(index, layout.num_drafts + 1)
            probs = self._target_probabilities(logits, positions)
        uniforms = self._shared.draw_run(0, 2 * layout.num_positions).reshape(2, -1)
        tokens = verify(layout, argmax, probs, is_greedy, self._to_device(uniforms))
        self._rows.num_output[index] += np.array([len(row) for row in tokens])
        return tokens

    def _target_probabilities(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """[T, vocab]: what `_draw_sampled` draws from, for position t of row rows[t]."""
        table = self._rows
        temperature = table.host_floats[_TEMPERATURE][rows].copy()
        temperature[temperature == 0.0] = 1.0  # a greedy row's (its argmax is used)
        temperature_tensor = self._to_device(temperature).unsqueeze(1)
        top_k, top_p, min_p = (table.top_k[rows], table.host_floats[_TOP_P][rows],
                               table.host_floats[_MIN_P][rows])
        thresholds = None
        if (top_k < self.vocab_size).any() or (top_p < 1.0).any() or (min_p > 0.0).any():
            thresholds = row_thresholds(logits / temperature_tensor, Truncation(
                top_k, top_p, min_p, *(self._to_device(np.ascontiguousarray(a))
                                       for a in (top_k, top_p, min_p))), self.host_reads)
        return target_probabilities(logits, temperature_tensor, thresholds)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    def _check_logits(self, logits: torch.Tensor, rows: list[int]) -> None:
        expected = (len(rows), self.vocab_size)
        if tuple(logits.shape) != expected:
            raise ValueError(f"sample() got logits of shape {tuple(logits.shape)}, expected "
                             f"{expected} (one row per sampled request, the whole vocabulary)")

    # ------------------------------------------------------------------ masks and penalties
    def _subset(self, step: _Step, flag: str | np.ndarray,
                ) -> tuple[np.ndarray, torch.Tensor | slice, torch.Tensor | slice] | None:
        """The step's positions whose row has `flag` (or where the mask is True), as
        numpy, as an index of the step's logits, and as an index of the batch's rows;
        None when there are none."""
        if isinstance(flag, str):
            if not self._rows.in_batch[flag]:
                return None
            chosen = self._rows.flag(flag, step.index)
        else:
            chosen = flag
        positions = np.flatnonzero(chosen)
        if not len(positions):
            return None
        if len(positions) == step.size:
            return positions, slice(None), step.rows
        return positions, self._to_device(positions), self._to_device(step.index[positions])

    def _apply_allowed_tokens(self, logits: torch.Tensor, step: _Step) -> None:
        subset = self._subset(step, "allowed")
        if subset is None:
            return
        _, positions, rows = subset
        assert self._rows.allowed_mask is not None
        allowed = self._rows.allowed_mask[rows]
        if isinstance(positions, slice):
            logits.masked_fill_(~allowed, _NEG_INF)
        else:
            logits[positions] = logits[positions].masked_fill(~allowed, _NEG_INF)

    def _apply_bad_words(self, logits: torch.Tensor, step: _Step) -> None:
        """Mask each word's last token where the row's latest tokens equal the rest of it:
        the words' prefixes against the rows' recent tokens, all in one comparison."""
        if self._subset(step, "bad_words") is None:
            return
        table = self._rows
        position_of = np.full(table.capacity, -1, dtype=np.int64)
        position_of[step.index] = np.arange(step.size)
        word_positions = position_of[table.word_rows]
        words = np.flatnonzero(word_positions >= 0)
        if not len(words):
            return
        assert table.history is not None
        chosen = self._to_device(words)
        prefix = table.word_prefix[chosen]
        recent = table.history[self._to_device(table.word_rows[words])]
        match = ((recent == prefix) | (prefix < 0)).all(-1)
        logits.index_put_((self._to_device(word_positions[words]), table.word_last[chosen]),
                          torch.where(match, _NEG_INF, 0.0), accumulate=True)

    def _apply_logit_bias(self, logits: torch.Tensor, step: _Step) -> None:
        subset = self._subset(step, "bias")
        if subset is None:
            return
        _, positions, rows = subset
        ids, values = self._rows.bias_ids[rows], self._rows.bias_values[rows]
        if isinstance(positions, slice):
            logits.scatter_add_(1, ids, values)
        else:
            logits.index_put_((positions.unsqueeze(1).expand_as(ids), ids), values,
                              accumulate=True)

    def _apply_min_tokens(self, logits: torch.Tensor, step: _Step) -> None:
        table, index = self._rows, step.index
        if not table.in_batch["blocked"]:
            return
        below = table.flag("blocked", index) & (table.num_output[index] < table.min_tokens[index])
        subset = self._subset(step, below)
        if subset is None:
            return
        positions_np, _, rows = subset
        ids = table.blocked[rows]
        positions = self._to_device(positions_np).unsqueeze(1).expand_as(ids)
        logits.index_put_((positions, ids), torch.full((), _NEG_INF, device=logits.device))

    def _apply_penalties(self, logits: torch.Tensor, step: _Step) -> None:
        """vLLM's (and OpenAI's) definitions, in vLLM's order: repetition over prompt and
        output (a positive logit divided by it, a negative one multiplied, as transformers'
        RepetitionPenaltyLogitsProcessor), then frequency (times each token's count in the
        output) and presence (once per token the output holds) subtracted."""
        subset = self._subset(step, "penalties")
        if subset is None:
            return
        positions_np, _, rows = subset
        table = self._rows
        positions = self._to_device(positions_np)
        selected = logits[positions]  # [m, vocab], a copy
        assert table.counts is not None
        counts = table.counts[rows]
        in_output = counts > 0
        floats = table.floats
        if table.flag("repeats", step.index[positions_np]).any():
            assert table.prompt_seen is not None
            seen = in_output | table.prompt_seen[rows]
            penalty = floats[_REPETITION][rows].unsqueeze(1)
            penalised = torch.where(selected > 0, selected / penalty, selected * penalty)
            selected = torch.where(seen, penalised, selected)
        frequency, presence = floats[_FREQUENCY][rows], floats[_PRESENCE][rows]
        selected -= frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * in_output
        logits[positions] = selected

    def _follow(self, step: _Step, tokens: torch.Tensor, is_ok: torch.Tensor,
                failed: np.ndarray) -> None:
        """Count the step's tokens as appended to their outputs, on the device where the
        penalties' counts and the bad words' recent tokens live (a failed row ends)."""
        table, index = self._rows, step.index
        table.num_output[index] += 1
        if not (table.in_batch["penalties"] or table.in_batch["bad_words"]):
            return
        done = np.zeros(step.size, dtype=np.bool_)
        done[failed] = True
        counted = self._subset(step, table.flag("penalties", index) & ~done)
        if counted is not None:
            positions, _, rows = counted
            chosen = self._to_device(positions)
            assert table.counts is not None
            table.counts.index_put_((_as_index(rows, index[positions], self.device),
                                     tokens[chosen]), is_ok[chosen].float(), accumulate=True)
        recent = self._subset(step, table.flag("bad_words", index) & ~done)
        if recent is not None and table.history is not None and table.history.shape[1]:
            positions, _, rows = recent
            rows = _as_index(rows, index[positions], self.device)
            latest = tokens[self._to_device(positions)].unsqueeze(1)
            table.history[rows] = torch.cat([table.history[rows][:, 1:], latest], 1)

    # ------------------------------------------------------------------ logits processors
    def _apply_processors(self, logits: torch.Tensor, rows: list[int], step: _Step,
                          ) -> tuple[torch.Tensor, str | None]:
        if not self.processors or self._pending_failure is not None:
            return logits, None
        greedy_only = bool(self._rows.flag("greedy", step.index).all())
        active = self._greedy_processors if greedy_only else self.processors
        if not active:
            return logits, None
        batch, index = self._batch_view(logits, step)
        for processor in active:
            try:
                batch = _checked(processor.apply(batch), batch.shape)
            except Exception as exc:  # a plugin's bug fails requests, never the worker
                return logits, _failure(processor, "apply", exc)
        return (batch if index is None else batch[index]), None

    def _batch_view(self, logits: torch.Tensor, step: _Step,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The [batch_size, vocab] tensor the processors' contract promises, and the index
        that takes this step's rows back out of it (None: the logits themselves).

        When the step samples only some rows (chunked prefill), the logits are copied into
        a buffer reused across steps; its other rows hold stale values, ignored after."""
        batch_size = self._rows.batch_size
        if step.is_whole_batch:
            return logits, None
        buffer = self._batch_buffer
        if (buffer is None or buffer.shape[0] < batch_size or buffer.device != logits.device):
            buffer = torch.zeros(max(batch_size, 2 * (0 if buffer is None else len(buffer))),
                                 self.vocab_size, device=logits.device)
            self._batch_buffer = buffer
        index = self._to_device(step.index)
        batch = buffer[:batch_size]
        batch.index_copy_(0, index, logits)
        return batch, index

    # ------------------------------------------------------------------ the draw
    def _draw(self, logits: torch.Tensor, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
        sampled = np.flatnonzero(~self._rows.flag("greedy", step.index))
        if len(sampled) == step.size:  # every row samples: work on the logits in place
            return self._draw_sampled(logits, step.index, step.rows)
        values, tokens = logits.max(-1)  # the greedy rows' tokens
        is_ok = values > _NEG_INF
        if len(sampled):
            positions = self._to_device(sampled)
            rows = step.index[sampled]
            tokens[positions], is_ok[positions] = self._draw_sampled(
                logits[positions], rows, self._to_device(rows))
        return tokens, is_ok

    def _draw_sampled(self, logits: torch.Tensor, rows: np.ndarray,
                      rows_index: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._rows
        host, floats = table.host_floats, table.floats
        if (host[_TEMPERATURE][rows] != 1.0).any():
            logits.div_(floats[_TEMPERATURE][rows_index].unsqueeze(1))
        top_k, top_p, min_p = table.top_k[rows], host[_TOP_P][rows], host[_MIN_P][rows]
        thresholds = None
        if (top_k < self.vocab_size).any() or (top_p < 1.0).any() or (min_p > 0.0).any():
            thresholds = row_thresholds(logits, Truncation(
                top_k, top_p, min_p, table.top_k_tensor[rows_index],
                floats[_TOP_P][rows_index], floats[_MIN_P][rows_index]), self.host_reads)
        return draw(logits, thresholds, self._to_device(self._uniforms(rows)))

    def _uniforms(self, rows: np.ndarray) -> np.ndarray:
        """One uniform per row: a seeded row draws from its own twister, exactly one
        number per step, so its tokens do not depend on its batch companions."""
        seeded = self._rows.flag("seeded", rows)
        uniforms = np.empty(len(rows), dtype=np.float32)
        uniforms[~seeded] = self._shared.draw_run(0, int((~seeded).sum()))
        if seeded.any():
            uniforms[seeded] = self._rows.seeds.draw(rows[seeded])
        return uniforms


class _Step:
    """The persistent-batch rows one step samples, as numpy and as an index of the rows'
    device tensors (a slice where they are rows 0..n-1)."""

    def __init__(self, index: np.ndarray, batch_size: int, device: torch.device) -> None:
        self.index, self.size = index, len(index)
        in_order = bool((index == np.arange(self.size)).all())
        self.is_whole_batch = in_order and self.size == batch_size
        self.rows: torch.Tensor | slice = (slice(0, self.size) if in_order
                                           else to_device(index, device))


def _as_index(rows: torch.Tensor | slice, numpy_rows: np.ndarray,
              device: torch.device) -> torch.Tensor:
    """A row index as a tensor (index_put_ takes no slices)."""
    return rows if isinstance(rows, torch.Tensor) else to_device(numpy_rows, device)


def _instantiate(cls: type[LogitsProcessor], model_config: ModelConfig,
                 device: torch.device) -> LogitsProcessor:
    try:
        return cls(model_config, device, False)
    except Exception as exc:
        raise PluginError(f"Logits processor {class_name(cls)} failed to initialise in "
                          f"process {process_role()} (pid {os.getpid()}): "
                          f"{type(exc).__name__}: {exc}") from exc


def _checked(result: object, shape: torch.Size) -> torch.Tensor:
    if not isinstance(result, torch.Tensor) or result.shape != shape:
        got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
        raise TypeError(f"apply() returned {got}, expected a tensor of shape {tuple(shape)}")
    return result


def _failure(processor: LogitsProcessor, method: str, exc: Exception) -> str:
    name = class_name(type(processor))
    logger.exception("Logits processor %s raised in %s(); this step's rows fail.", name, method)
    return f"logits processor {name} raised in {method}(): {type(exc).__name__}: {exc}"
