"""The pooling model runner (worker process): embeds every request of a step at once.

A pooling request arrives as a new request with its whole prompt scheduled, and leaves in
the same step with its vector, so the runner keeps nothing between steps and there is no
KV cache. Each step: check the requests, pack their prompts shortest first into one flat
batch, run the encoder once, pool each sequence's hidden states in float32 (the model's
pooling method), then per request keep the first `dimensions` values and L2-normalise if
asked (None: the model's default). A request the runner cannot embed (empty, too long, a
token outside the vocabulary, an unsupported parameter) is answered in `errors`; the others
still run.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gateway.messages import ModelRunnerOutput, NewRequestData, PoolingParams, SchedulerOutput
from gateway.models.paths import PoolingConfig


class PoolingModel(Protocol):
    """What the runner needs of an encoder class (ours, or one a plugin registers)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 seq_lens: Sequence[int]) -> torch.Tensor:
        """input_ids, positions [N] of packed sequences -> hidden states [N, E]."""
        ...


@dataclass
class _Request:
    req_id: str
    token_ids: list[int]
    params: PoolingParams


class PoolingModelRunner:
    def __init__(self, model: nn.Module, pooling: PoolingConfig, device: torch.device,
                 max_model_len: int, vocab_size: int, hidden_size: int) -> None:
        self.model: PoolingModel = cast(PoolingModel, model)
        self.pooling = pooling
        self.device = device
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.hidden_size = hidden_size

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
        hidden = self.model(*self._inputs(requests, seq_lens), seq_lens)  # [N, E]
        pooled = pool(hidden.float(), seq_lens, self.pooling.method).cpu()  # [S, E] float32
        normalized = F.normalize(pooled, dim=-1)
        for row, request in enumerate(requests):
            vector = self._finish(pooled[row], normalized[row], request.params)
            output.pooler_outputs[request.req_id] = vector.numpy().tobytes()
        return output

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
        """Why the request cannot be embedded, or None."""
        params, token_ids = request.pooling_params, request.prompt_token_ids
        if params is None or params.task != "embed":
            return (f"This model only embeds (task 'embed'); the request asks for "
                    f"{'generation' if params is None else repr(params.task)}")
        if not token_ids:
            return "The input is empty: there is nothing to embed"
        if len(token_ids) > self.max_model_len:
            return (f"The input has {len(token_ids)} tokens, more than the model's "
                    f"{self.max_model_len}")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            return f"The input holds token ids outside the vocabulary [0, {self.vocab_size})"
        if params.dimensions is not None and not 0 < params.dimensions <= self.hidden_size:
            return (f"dimensions {params.dimensions} must be between 1 and the model's "
                    f"{self.hidden_size}")
        return None

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
