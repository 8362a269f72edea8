"""Today's sampler as it was before sampling moved onto persistent device tensors (the
reference the vectorised sampler is tested against): sampling_rows, penalties,
sampling_ops and sampler of the worker, one after the other, unchanged but for imports.
Only the `Sampler` class is used; logits processors are not part of the reference."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gateway.config import ModelConfig
from gateway.logger import init_logger
from gateway.models.kernels.cpu import sampling as cpu_sampling
from gateway.plugins.contracts import BatchUpdate, LogitsProcessor, MoveDirectionality
from gateway.plugins.loader import PluginError
from gateway.plugins.process import process_role
from gateway.sampling_params import SamplingParams
from gateway.worker.logits_processors import class_name, load_logits_processor_classes

# ------------------------------------------------------------ sampling_rows.py


_SEED_MASK = (1 << 64) - 1  # torch generators take seeds in [0, 2**64)


@dataclass(slots=True)
class RequestRow:
    params: SamplingParams
    #: The runner's own list: it grows in place as the request generates.
    output_token_ids: list[int]
    #: A seeded sampled request draws from its own CPU generator, one number per step, so
    #: its tokens do not depend on the rest of the batch. None: the shared generator.
    generator: torch.Generator | None
    bias_token_ids: list[int]
    bias_values: list[float]
    #: EOS and stop token ids, masked while fewer than `min_tokens` tokens are out.
    min_tokens_blocked: list[int]
    #: A parameter this worker cannot honour; every step of the request fails with it.
    error: str | None = None
    #: The prompt (for the repetition penalty).
    prompt_token_ids: list[int] | None = None
    #: [vocab] bool, True for the allowed_token_ids; None: every token is allowed.
    allowed_mask: torch.Tensor | None = None

    @property
    def is_greedy(self) -> bool:
        return self.params.temperature == 0.0

    @property
    def is_below_min_tokens(self) -> bool:
        return len(self.output_token_ids) < self.params.min_tokens


def make_row(params: SamplingParams, output_token_ids: list[int], vocab_size: int,
             eos_token_ids: list[int], prompt_token_ids: list[int] | None = None
             ) -> RequestRow:
    bias = params.logit_bias or {}
    kept = {t: b for t, b in bias.items() if 0 <= t < vocab_size}
    bad = [t for t in bias if t not in kept]
    error = (f"logit_bias names token id {bad[0]}, outside the vocabulary "
             f"[0, {vocab_size})") if bad else None
    blocked = [t for t in dict.fromkeys([*eos_token_ids, *params.stop_token_ids])
               if 0 <= t < vocab_size]
    generator = _generator(params, len(output_token_ids))
    allowed = [t for t in params.allowed_token_ids or [] if 0 <= t < vocab_size]
    if params.allowed_token_ids is not None and not allowed:
        error = error or "allowed_token_ids holds no token id of the vocabulary"
    mask = None
    if allowed:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[allowed] = True
    bad_ids = [t for words in params.bad_words_token_ids for t in words
               if not 0 <= t < vocab_size]
    if bad_ids:
        error = error or f"bad_words tokenize to id {bad_ids[0]}, outside the vocabulary"
    return RequestRow(params, output_token_ids, generator, list(kept), list(kept.values()),
                      blocked, error, prompt_token_ids or [], mask)


def _generator(params: SamplingParams, num_done: int) -> torch.Generator | None:
    if params.seed is None or params.temperature == 0.0:
        return None
    generator = torch.Generator().manual_seed(params.seed & _SEED_MASK)
    if num_done:
        # A request re-added after preemption: skip the draws of the tokens it already
        # has, so it continues exactly as it would have without the preemption.
        torch.rand(num_done, generator=generator)
    return generator


class BatchRows:
    """Row index -> RequestRow, for the rows of the persistent batch."""

    def __init__(self, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.batch_size = 0
        self._rows: list[RequestRow | None] = []

    def apply(self, update: BatchUpdate) -> None:
        for row in update.removed:
            if row < len(self._rows):
                self._rows[row] = None
        for row, params, prompt_token_ids, output_token_ids in update.added:
            self._grow(row + 1)
            self._rows[row] = make_row(params, output_token_ids, self.vocab_size,
                                       self.eos_token_ids, prompt_token_ids)
        for source, target, direction in update.moved:
            self._grow(max(source, target) + 1)
            if direction is MoveDirectionality.SWAP:
                self._rows[source], self._rows[target] = self._rows[target], self._rows[source]
            else:
                self._rows[target], self._rows[source] = self._rows[source], None
        self.batch_size = update.batch_size
        self._grow(update.batch_size)

    def get(self, row: int) -> RequestRow:
        entry = self._rows[row] if 0 <= row < self.batch_size else None
        if entry is None:
            raise ValueError(f"row {row} of the persistent batch holds no request "
                             f"(batch size {self.batch_size}); was its BatchUpdate applied?")
        return entry

    def _grow(self, size: int) -> None:
        if size > len(self._rows):
            self._rows.extend([None] * (size - len(self._rows)))
# ------------------------------------------------------------ penalties.py


_NEG_INF = float("-inf")


def apply_allowed_tokens(logits: torch.Tensor, requests: Sequence[RequestRow]) -> None:
    positions = [i for i, req in enumerate(requests) if req.allowed_mask is not None]
    if not positions:
        return
    masks = torch.stack([requests[i].allowed_mask for i in positions])  # type: ignore[misc]
    index = torch.tensor(positions, device=logits.device)
    logits[index] = logits[index].masked_fill(~masks.to(logits.device), _NEG_INF)


def apply_bad_words(logits: torch.Tensor, requests: Sequence[RequestRow]) -> None:
    positions: list[int] = []
    token_ids: list[int] = []
    for i, req in enumerate(requests):
        output = req.output_token_ids
        for word in req.params.bad_words_token_ids:
            prefix = word[:-1]
            if not prefix or output[len(output) - len(prefix):] == prefix:
                positions.append(i)
                token_ids.append(word[-1])
    if token_ids:
        index = (torch.tensor(positions, device=logits.device),
                 torch.tensor(token_ids, device=logits.device))
        logits.index_put_(index, torch.tensor(_NEG_INF, device=logits.device))


def apply_penalties(logits: torch.Tensor, requests: Sequence[RequestRow]) -> None:
    """logits [n, vocab], changed in place for the rows with a penalty."""
    positions = [i for i, req in enumerate(requests) if req.params.has_penalties]
    if not positions:
        return
    device, vocab = logits.device, logits.shape[1]
    rows = [requests[i] for i in positions]
    index = torch.tensor(positions, device=device)
    selected = logits[index]  # [m, vocab], a copy
    counts = _token_counts([r.output_token_ids for r in rows], vocab, device)
    in_output = counts > 0
    repetition = [r.params.repetition_penalty for r in rows]
    if any(p != 1.0 for p in repetition):
        seen = in_output | (_token_counts([r.prompt_token_ids or [] for r in rows], vocab,
                                          device) > 0)
        penalty = torch.tensor(repetition, device=device).unsqueeze(1)
        penalised = torch.where(selected > 0, selected / penalty, selected * penalty)
        selected = torch.where(seen, penalised, selected)
    frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=device)
    presence = torch.tensor([r.params.presence_penalty for r in rows], device=device)
    selected -= frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * in_output
    logits[index] = selected


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int,
                  device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how often each token occurs in each list."""
    counts = torch.zeros(len(token_lists), vocab, device=device)
    rows = [i for i, tokens in enumerate(token_lists) for _ in tokens]
    if rows:
        flat = [t for tokens in token_lists for t in tokens]
        counts.index_put_((torch.tensor(rows, device=device), torch.tensor(flat, device=device)),
                          torch.ones(len(flat), device=device), accumulate=True)
    return counts
# ------------------------------------------------------------ sampling_ops.py


# Top-p bins each row's logits by distance below its best, over this span.
_NUM_BINS = 4096
_BINNED_SPAN = 40.0
_NEG_INF = float("-inf")


def truncation_thresholds(logits: torch.Tensor, top_k: list[int | None], top_p: list[float],
                          min_p: list[float]) -> torch.Tensor | None:
    """Per row, the lowest logit kept by top-k, then top-p (over the top-k distribution),
    then min-p: [n, 1]; None when no row truncates.

    logits: [n, vocab], already divided by the temperature. A token whose logit ties the
    threshold is kept, so a tie can keep more than k tokens.
    """
    num_rows, vocab = logits.shape
    ks = [k if k is not None and k < vocab else None for k in top_k]
    k_rows = [i for i in range(num_rows) if ks[i] is not None]
    p_rows = [i for i in range(num_rows) if ks[i] is None and top_p[i] < 1.0]
    has_min_p = any(p > 0.0 for p in min_p)
    if not k_rows and not p_rows and not has_min_p:
        return None
    thresholds = torch.full((num_rows,), _NEG_INF, device=logits.device)
    if k_rows:
        thresholds[_index(k_rows, logits)] = _top_k_thresholds(
            _rows(logits, k_rows), [ks[i] or vocab for i in k_rows], [top_p[i] for i in k_rows])
    if p_rows:
        thresholds[_index(p_rows, logits)] = _top_p_thresholds(
            _rows(logits, p_rows), torch.tensor([top_p[i] for i in p_rows], device=logits.device))
    if has_min_p:
        # p_i >= min_p * p_max  <=>  logit_i >= max_logit + log(min_p)  (log 0 = -inf)
        log_min_p = torch.tensor(min_p, device=logits.device).log()
        thresholds = torch.maximum(thresholds, logits.amax(-1) + log_min_p)
    return thresholds.unsqueeze(1)


def _top_k_thresholds(logits: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """[m] thresholds of rows with a top-k, and a top-p over their top k (p = 1: none)."""
    device = logits.device
    k = torch.tensor(ks, device=device)
    values = logits.topk(max(ks), -1).values  # [m, K], descending
    in_top_k = torch.arange(values.shape[1], device=device) < k.unsqueeze(1)
    k_threshold = values.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
    if all(p >= 1.0 for p in ps):
        return k_threshold
    norm = values.masked_fill(~in_top_k, _NEG_INF).logsumexp(-1, keepdim=True)
    probs = (values - norm).exp() * in_top_k
    p = torch.tensor(ps, device=device)
    p_threshold = _nucleus_threshold(values, probs, torch.zeros_like(p), p)
    return torch.maximum(k_threshold, torch.where(p < 1.0, p_threshold, _NEG_INF))


def _top_p_thresholds(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """[m] exact top-p thresholds over whole rows, without sorting them.

    The probability mass is binned by distance below the row's best logit; the cumulative
    mass over the bins finds the bin where p is reached, and only that bin's tokens are
    sorted, instead of a full sort of the row (docs/cpu-performance.md).
    """
    best = logits.amax(-1, keepdim=True)
    bad = ~torch.isfinite(best)  # -inf or NaN rows: any threshold, they cannot sample
    if bad.any():
        logits, best = logits.masked_fill(bad, 0.0), best.masked_fill(bad, 0.0)
    gap = best - logits  # >= 0; inf for a -inf token
    weights = gap.neg().exp_()  # unnormalised probabilities, the best one is 1
    target = p.unsqueeze(1) * weights.sum(-1, keepdim=True)  # p in the weights' units
    # each token's bin (-inf: the last); via int32, much faster than a direct int64 cast
    bins = gap.mul_(_NUM_BINS / _BINNED_SPAN).clamp_(max=_NUM_BINS - 1).int().long()
    mass = torch.zeros(len(logits), _NUM_BINS, device=logits.device)
    cumulative = mass.scatter_add_(1, bins, weights).cumsum_(-1)
    boundary = (cumulative < target).sum(-1).clamp_(max=_NUM_BINS - 1)
    before = cumulative.gather(1, (boundary - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    before = torch.where(boundary > 0, before, 0.0)
    in_boundary = bins == boundary.unsqueeze(1)
    width = int(in_boundary.sum(-1, dtype=torch.int32).max().clamp(min=1))
    values = torch.where(in_boundary, logits, _NEG_INF).topk(width, -1).values
    return _nucleus_threshold(values, (values - best).exp(), before, target.squeeze(1))


def _nucleus_threshold(values: torch.Tensor, probs: torch.Tensor, mass_before: torch.Tensor,
                       p: torch.Tensor) -> torch.Tensor:
    """Given candidate logits `values` [m, K] in descending order, their probabilities and
    the probability of the tokens above them, the last logit of the smallest prefix whose
    probability reaches p: a token stays while the mass before it is below p."""
    cumulative = mass_before.unsqueeze(1) + probs.cumsum(-1)
    num_kept = (cumulative - probs < p.unsqueeze(1)).sum(-1).clamp(min=1)
    return values.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1)


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, device=like.device)


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return logits if len(rows) == len(logits) else logits[_index(rows, logits)]


def draw(logits: torch.Tensor, thresholds: torch.Tensor | None,
         uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row by inverting the CDF at `uniforms` ([n] in [0, 1)).

    logits: [n, vocab] (temperature applied); thresholds: [n, 1] or None. Returns the
    tokens [n] and whether each row could be sampled [n] (False: every token is masked,
    or the row holds NaN). One uniform per row keeps a seeded row independent of the
    others: its token depends only on its own logits and its own draw.

    On a CPU the gateway's kernel does it in one call (cpu_sampling.draw: two reads of
    each row, no temporaries; the same tokens up to the last bit of exp); elsewhere torch's
    ops below.
    """
    fast = cpu_sampling.draw(logits, thresholds, uniforms)
    return fast if fast is not None else draw_with_torch(logits, thresholds, uniforms)


def draw_with_torch(logits: torch.Tensor, thresholds: torch.Tensor | None,
                    uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw` through torch's ops (any device)."""
    weights = (logits - logits.amax(-1, keepdim=True)).exp_()
    if thresholds is not None:
        weights.masked_fill_(logits < thresholds, 0.0)
    cumulative = weights.cumsum_(-1)
    total = cumulative[:, -1:]
    # u * total < total, so the chosen token has weight > 0, even when u * total rounds up.
    target = torch.minimum(uniforms.unsqueeze(1) * total,
                           total.nextafter(torch.zeros_like(total)))
    tokens = torch.searchsorted(cumulative, target, right=True).squeeze(1)
    is_ok = torch.isfinite(total.squeeze(1)) & (total.squeeze(1) > 0)
    return tokens.clamp_(max=logits.shape[1] - 1), is_ok
# ------------------------------------------------------------ sampler.py



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
        apply_allowed_tokens(logits, requests)
        apply_bad_words(logits, requests)
        _apply_logit_bias(logits, requests)
        _apply_min_tokens(logits, requests)
        apply_penalties(logits, requests)
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
