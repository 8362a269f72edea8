"""The sampler: one token per persistent-batch row each step (worker process).

Each step, in order: allowed_token_ids, bad_words, logit_bias, min_tokens (EOS and stop ids
masked until enough tokens are out), the penalties, the logits-processor plugins, then
greedy argmax or temperature, top-k, top-p, min-p and a draw; `sample()` works in place.
A logits processor's failure does not escape, and since a processor keeps its own notion
of its rows, it fails every row of the step: when one raises in `apply()` (or returns
something other than a tensor of the batch's shape), or raised in `update_state()` since
the last `sample()`, every row fails with its error and the other processors are skipped
for the step. The processor is called again next step.
"""

from __future__ import annotations

import os

import torch

from gateway.config import ModelConfig
from gateway.logger import init_logger
from gateway.plugins.contracts import BatchUpdate, LogitsProcessor
from gateway.plugins.loader import PluginError
from gateway.plugins.process import process_role
from gateway.worker import penalties
from gateway.worker.logits_processors import (
    class_name,
    load_logits_processor_classes,
    validate_request,
)
from gateway.worker.sampling_ops import draw, truncation_thresholds
from gateway.worker.sampling_rows import BatchRows, RequestRow

__all__ = ["Sampler", "load_logits_processor_classes", "validate_request"]

logger = init_logger(__name__)

_NEG_INF = float("-inf")
_UNSAMPLEABLE = "no token can be sampled: every logit is -inf or NaN"


class Sampler:
    """Built once per worker; `update_state()` then `sample()` every step."""

    def __init__(self, model_config: ModelConfig, vocab_size: int, eos_token_ids: list[int],
                 device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.processor_classes = load_logits_processor_classes(model_config)
        self.processors = [_instantiate(cls, model_config, device)
                           for cls in self.processor_classes]
        # Asked once, as vLLM does: the answer is part of the processor's definition.
        self._greedy_processors = [p for p in self.processors if not p.is_argmax_invariant()]
        self._rows = BatchRows(vocab_size, eos_token_ids)
        # Unseeded rows share one generator (seeded from the model config); seeded rows
        # each have their own. All live on the CPU: a draw is one number per row.
        self._shared_generator = torch.Generator().manual_seed(model_config.seed)
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

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[int]) -> tuple[list[int], dict[int, str]]:
        """logits: [len(rows), vocab_size] for these persistent-batch rows, modified in place.

        Returns the token per row (same order) and {row: error} for rows that failed this
        step; a failed row's token is meaningless and must be dropped.
        """
        requests = [self._rows.get(row) for row in rows]
        self._check_logits(logits, rows)
        logits = logits.float()
        errors = {row: req.error for row, req in zip(rows, requests) if req.error}
        penalties.apply_allowed_tokens(logits, requests)
        penalties.apply_bad_words(logits, requests)
        _apply_logit_bias(logits, requests)
        _apply_min_tokens(logits, requests)
        penalties.apply_penalties(logits, requests)
        logits, failure = self._apply_processors(logits, rows, requests)
        failure, self._pending_failure = self._pending_failure or failure, None
        tokens, is_ok = self._draw(logits, requests)
        for row, ok in zip(rows, is_ok):
            if failure is not None:
                errors[row] = failure
            elif not ok:
                errors.setdefault(row, _UNSAMPLEABLE)
        return tokens, errors

    def _check_logits(self, logits: torch.Tensor, rows: list[int]) -> None:
        expected = (len(rows), self.vocab_size)
        if tuple(logits.shape) != expected:
            raise ValueError(f"sample() got logits of shape {tuple(logits.shape)}, expected "
                             f"{expected} (one row per sampled request, the whole vocabulary)")

    def _apply_processors(self, logits: torch.Tensor, rows: list[int],
                          requests: list[RequestRow]) -> tuple[torch.Tensor, str | None]:
        greedy_only = all(req.is_greedy for req in requests)
        active = self._greedy_processors if greedy_only else self.processors
        if not active or self._pending_failure is not None:
            return logits, None
        batch, index = self._batch_view(logits, rows)
        for processor in active:
            try:
                batch = _checked(processor.apply(batch), batch.shape)
            except Exception as exc:  # a plugin's bug fails requests, never the worker
                return logits, _failure(processor, "apply", exc)
        return (batch if index is None else batch[index]), None

    def _batch_view(self, logits: torch.Tensor, rows: list[int],
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The [batch_size, vocab] tensor the processors' contract promises, and the index
        that takes this step's rows back out of it (None: the logits themselves).

        When the step samples only some rows (chunked prefill), the logits are copied into
        a buffer reused across steps; its other rows hold stale values, ignored after."""
        batch_size = self._rows.batch_size
        if len(rows) == batch_size and all(row == i for i, row in enumerate(rows)):
            return logits, None
        buffer = self._batch_buffer
        if (buffer is None or buffer.shape[0] < batch_size or buffer.device != logits.device):
            buffer = torch.zeros(max(batch_size, 2 * (0 if buffer is None else len(buffer))),
                                 self.vocab_size, device=logits.device)
            self._batch_buffer = buffer
        index = torch.tensor(rows, device=logits.device)
        batch = buffer[:batch_size]
        batch.index_copy_(0, index, logits)
        return batch, index

    def _draw(self, logits: torch.Tensor, requests: list[RequestRow],
              ) -> tuple[list[int], list[bool]]:
        positions = [i for i, req in enumerate(requests) if not req.is_greedy]
        if len(positions) == len(requests):  # every row samples: work on the logits in place
            return _to_lists(*self._draw_sampled(logits, requests))
        values, tokens = logits.max(-1)  # the greedy rows' tokens
        is_ok = values > _NEG_INF
        if positions:
            index = torch.tensor(positions, device=logits.device)
            tokens[index], is_ok[index] = self._draw_sampled(
                logits[index], [requests[i] for i in positions])
        return _to_lists(tokens, is_ok)

    def _draw_sampled(self, logits: torch.Tensor, requests: list[RequestRow],
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        device = logits.device
        params = [req.params for req in requests]
        temperatures = [p.temperature for p in params]
        if any(t != 1.0 for t in temperatures):
            logits.div_(torch.tensor(temperatures, device=device).unsqueeze(1))
        thresholds = truncation_thresholds(logits, [p.top_k for p in params],
                                           [p.top_p for p in params], [p.min_p for p in params])
        uniforms = torch.tensor(self._uniforms(requests)).to(device)
        return draw(logits, thresholds, uniforms)

    def _uniforms(self, requests: list[RequestRow]) -> list[float]:
        """One uniform per row: a seeded row draws from its own generator, exactly one
        number per step, so its tokens do not depend on its batch companions."""
        num_shared = sum(req.generator is None for req in requests)
        shared = iter(torch.rand(num_shared, generator=self._shared_generator).tolist())
        return [next(shared) if req.generator is None
                else torch.rand(1, generator=req.generator).item() for req in requests]


def _apply_logit_bias(logits: torch.Tensor, requests: list[RequestRow]) -> None:
    positions: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for i, req in enumerate(requests):
        positions += [i] * len(req.bias_token_ids)
        token_ids += req.bias_token_ids
        biases += req.bias_values
    if token_ids:
        index = (torch.tensor(positions, device=logits.device),
                 torch.tensor(token_ids, device=logits.device))
        logits.index_put_(index, torch.tensor(biases, device=logits.device), accumulate=True)


def _apply_min_tokens(logits: torch.Tensor, requests: list[RequestRow]) -> None:
    positions: list[int] = []
    token_ids: list[int] = []
    for i, req in enumerate(requests):
        if req.min_tokens_blocked and req.is_below_min_tokens:
            positions += [i] * len(req.min_tokens_blocked)
            token_ids += req.min_tokens_blocked
    if token_ids:
        index = (torch.tensor(positions, device=logits.device),
                 torch.tensor(token_ids, device=logits.device))
        logits.index_put_(index, torch.tensor(_NEG_INF, device=logits.device))


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


def _to_lists(tokens: torch.Tensor, is_ok: torch.Tensor) -> tuple[list[int], list[bool]]:
    both = torch.stack([tokens, is_ok.to(tokens.dtype)]).tolist()  # one device sync
    return both[0], [bool(ok) for ok in both[1]]
