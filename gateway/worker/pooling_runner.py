"""The pooling model runner (worker process): pools every request of a step at once.

A pooling request arrives with its whole prompt scheduled and leaves in the same step with
its vector: nothing is kept between steps, and there is no KV cache. Each step packs the
prompts shortest first into one flat batch (with token types for a BERT sentence pair),
runs the encoder once, then, in float32, per request by its task: embed (pool, keep the
first `dimensions` values, L2-normalise if asked) or classify / score (the model's head,
its logits through the task's activation unless `use_activation` is False). A request the
runner cannot pool (empty, too long, a token outside the vocabulary, a task or parameter
the model cannot do) is answered in `errors`; the others still run.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gateway.messages import ModelRunnerOutput, NewRequestData, PoolingParams, SchedulerOutput
from gateway.models.info.paths import PoolingConfig


class PoolingModel(Protocol):
    """What the runner needs of an encoder class (ours, or one a plugin registers). It is
    given `token_type_ids` only for a step that holds a sentence pair, and only when it
    has `num_token_types` of 2 or more. A classifier (tasks classify, score) also has
    `classify(hidden, seq_lens) -> logits [S, C]` and `activate(logits, task) -> [S, C]`."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 seq_lens: Sequence[int], **kwargs: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [N] of packed sequences -> hidden states [N, E]."""
        ...


@dataclass
class _Request:
    req_id: str
    token_ids: list[int]
    params: PoolingParams


class PoolingModelRunner:
    def __init__(self, model: nn.Module, pooling: PoolingConfig, device: torch.device,
                 max_model_len: int, vocab_size: int, hidden_size: int,
                 tasks: Sequence[str] = ("embed",)) -> None:
        self.model: PoolingModel = cast(PoolingModel, model)
        self.classifier: Any = model  # classify() and activate(), for classify and score
        self.pooling = pooling
        self.device = device
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.hidden_size = hidden_size
        self.tasks = tuple(tasks)
        self.num_token_types = int(getattr(model, "num_token_types", 1))

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        requests = []
        for new in self._scheduled(scheduler_output):
            error = self._check(new)
            if error is None:
                assert new.pooling_params is not None
                requests.append(_Request(new.req_id, new.prompt_token_ids, new.pooling_params))
            else:
                output.errors[new.req_id] = error
        if not requests:
            return output
        requests.sort(key=lambda r: len(r.token_ids))  # similar lengths attend together
        seq_lens = [len(r.token_ids) for r in requests]
        input_ids, positions = self._inputs(requests, seq_lens)
        token_types = self._token_types(requests, seq_lens)
        extra = {} if token_types is None else {"token_type_ids": token_types}
        hidden = self.model(input_ids, positions, seq_lens, **extra)  # [N, E]
        for request, vector in zip(requests, self._vectors(hidden, seq_lens, requests)):
            output.pooler_outputs[request.req_id] = vector.numpy().tobytes()
        return output

    def _vectors(self, hidden: torch.Tensor, seq_lens: list[int],
                 requests: list[_Request]) -> list[torch.Tensor]:
        """Each request's answer (float32, on the CPU), by its task."""
        tasks = {r.params.task for r in requests}
        if "embed" in tasks:
            pooled = pool(hidden.float(), seq_lens, self.pooling.method).cpu()  # [S, E]
            normalized = F.normalize(pooled, dim=-1)
        if tasks - {"embed"}:
            logits = self.classifier.classify(hidden, seq_lens).float()  # [S, C]
            activated = {task: self.classifier.activate(logits, task).cpu()
                         for task in tasks - {"embed"}}
            logits = logits.cpu()
        vectors = []
        for row, request in enumerate(requests):
            params = request.params
            if params.task == "embed":
                vectors.append(self._finish(pooled[row], normalized[row], params))
            else:
                use_activation = params.use_activation is not False
                vectors.append((activated[params.task] if use_activation else logits)[row])
        return vectors

    def _scheduled(self, scheduler_output: SchedulerOutput) -> list[NewRequestData]:
        """The step's requests: each new, with its whole prompt scheduled."""
        if scheduler_output.scheduled_cached_reqs:
            raise ValueError("A pooling model runs each request in one step; requests "
                             f"{[r.req_id for r in scheduler_output.scheduled_cached_reqs]} "
                             f"are scheduled as continuing")
        new_reqs = {r.req_id: r for r in scheduler_output.scheduled_new_reqs}
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = new_reqs.get(req_id)
            if request is None:
                raise ValueError(f"Request {req_id!r} is scheduled but was never sent")
            if num_tokens != len(request.prompt_token_ids) or request.num_computed_tokens:
                raise ValueError(f"Request {req_id!r}: a pooling request runs its whole prompt "
                                 f"({len(request.prompt_token_ids)} tokens) in one step, "
                                 f"not {num_tokens} tokens from {request.num_computed_tokens}")
        return [new_reqs[req_id] for req_id in scheduler_output.num_scheduled_tokens]

    def _check(self, request: NewRequestData) -> str | None:
        """Why the request cannot be pooled, or None."""
        params, token_ids = request.pooling_params, request.prompt_token_ids
        if params is None or params.task not in self.tasks:
            return (f"This model supports the tasks {', '.join(map(repr, self.tasks))}; the "
                    f"request asks for {'generation' if params is None else repr(params.task)}")
        if not token_ids:
            return "The input is empty: there is nothing to pool"
        if len(token_ids) > self.max_model_len:
            return (f"The input has {len(token_ids)} tokens, more than the model's "
                    f"{self.max_model_len}")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            return f"The input holds token ids outside the vocabulary [0, {self.vocab_size})"
        if params.dimensions is not None and not 0 < params.dimensions <= self.hidden_size:
            return (f"dimensions {params.dimensions} must be between 1 and the model's "
                    f"{self.hidden_size}")
        start = params.second_segment_start
        if start is not None and (self.num_token_types < 2 or not 0 < start < len(token_ids)):
            return (f"second_segment_start {start} needs a model with token types and a "
                    f"position inside the input of {len(token_ids)} tokens")
        return None

    def _token_types(self, requests: list[_Request],
                     seq_lens: list[int]) -> torch.Tensor | None:
        """token_type_ids [N]: 1 from each pair's second text on, else 0; None when no
        request of the step is a pair."""
        starts = [r.params.second_segment_start for r in requests]
        if all(start is None for start in starts):
            return None
        lengths = np.array(seq_lens, dtype=np.int64)
        offsets = np.cumsum(lengths) - lengths
        positions = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(offsets, lengths)
        first_type_1 = np.repeat([n if s is None else s for s, n in zip(starts, seq_lens)],
                                 lengths)
        return self._to_device((positions >= first_type_1).astype(np.int64))

    def _inputs(self, requests: list[_Request],
                seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions [N]: the prompts one after the other."""
        lengths = np.array(seq_lens, dtype=np.int64)
        offsets = np.cumsum(lengths) - lengths
        positions = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(offsets, lengths)
        token_ids = np.fromiter(itertools.chain.from_iterable(r.token_ids for r in requests),
                                dtype=np.int64, count=positions.size)
        return self._to_device(token_ids), self._to_device(positions)

    def _finish(self, pooled: torch.Tensor, normalized: torch.Tensor,
                params: PoolingParams) -> torch.Tensor:
        """One request's vector [E'] from its pooled [E] (and its normalised copy)."""
        normalize = self.pooling.normalize if params.normalize is None else params.normalize
        if params.dimensions is None:
            return normalized if normalize else pooled
        vector = pooled[:params.dimensions]
        return F.normalize(vector, dim=0) if normalize else vector

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)


def pool(hidden: torch.Tensor, seq_lens: Sequence[int], method: str) -> torch.Tensor:
    """hidden [N, E] of packed sequences -> one vector per sequence [S, E]: the mean over
    all tokens (special ones included, as sentence-transformers does), the first (CLS)
    token, the element-wise max, or the last token."""
    lengths = torch.tensor(seq_lens, dtype=torch.int64, device=hidden.device)
    ends = torch.cumsum(lengths, 0)
    if method == "cls":
        return hidden[ends - lengths]
    if method == "lasttoken":
        return hidden[ends - 1]
    seq_index = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden.device),
                                        lengths)  # [N]
    num_seqs, size = len(seq_lens), hidden.shape[1]
    if method == "mean":
        sums = hidden.new_zeros(num_seqs, size).index_add_(0, seq_index, hidden)
        return sums / lengths[:, None]
    if method == "max":
        return hidden.new_full((num_seqs, size), float("-inf")).scatter_reduce_(
            0, seq_index[:, None].expand(-1, size), hidden, "amax")
    raise ValueError(f"Pooling method {method!r} is not supported (mean, cls, max, lasttoken)")
