"""A minimal scheduler for worker tests: it feeds a Worker SchedulerOutputs the way the
engine core does (new requests, cached ones with new blocks, chunked prefill under a token
budget, finished ids), so tests can build mixed batches step by step; and one step of
pooling requests for an embedding model (`pooling_step`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gateway.messages import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    PoolingParams,
    SchedulerOutput,
)
from gateway.sampling_params import SamplingParams


@dataclass
class DriverRequest:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    is_new: bool = True

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output


class StepDriver:
    def __init__(self, worker, num_blocks: int, block_size: int = 16) -> None:  # type: ignore[no-untyped-def]
        self.worker, self.block_size = worker, block_size
        self.free_blocks = list(range(num_blocks))[::-1]
        self.running: list[DriverRequest] = []
        self.finished: list[str] = []
        self.last_scheduled: dict[str, int] = {}

    def add(self, req_id: str, prompt: list[int], params: SamplingParams) -> DriverRequest:
        request = DriverRequest(req_id, list(prompt), params)
        self.running.append(request)
        return request

    def finish(self, req_id: str) -> None:
        request = next(r for r in self.running if r.req_id == req_id)
        self.running.remove(request)
        self.free_blocks += request.block_ids
        self.finished.append(req_id)

    def step(self, budget: int = 2048, only: list[str] | None = None) -> ModelRunnerOutput:
        """Schedule the running requests in order (or just `only`) within `budget` tokens."""
        new, cached, scheduled = [], [], {}
        for request in self.running:
            if only is not None and request.req_id not in only:
                continue
            num = min(len(request.all_tokens) - request.num_computed, budget)
            if num <= 0:
                break
            needed = -(-(request.num_computed + num) // self.block_size) - len(request.block_ids)
            added = [self.free_blocks.pop() for _ in range(needed)]
            request.block_ids += added
            if request.is_new:
                new.append(NewRequestData(
                    req_id=request.req_id, prompt_token_ids=request.prompt,
                    sampling_params=request.params, block_ids=list(request.block_ids),
                    output_token_ids=list(request.output),
                    num_computed_tokens=request.num_computed))
                request.is_new = False
            else:
                cached.append(CachedRequestData(req_id=request.req_id, new_block_ids=added,
                                                num_computed_tokens=request.num_computed))
            scheduled[request.req_id] = num
            budget -= num
        output = self.worker.execute_model(SchedulerOutput(
            scheduled_new_reqs=new, scheduled_cached_reqs=cached,
            num_scheduled_tokens=scheduled, finished_req_ids=self.finished))
        self.finished, self.last_scheduled = [], scheduled
        by_id = {r.req_id: r for r in self.running}
        for req_id, num in scheduled.items():
            by_id[req_id].num_computed += num
        for req_id, token in zip(output.req_ids, output.sampled_token_ids):
            by_id[req_id].output.append(token)
        return output

    def preempt(self, req_id: str) -> None:
        """Free the request's blocks and send it again later as new (recompute)."""
        request = next(r for r in self.running if r.req_id == req_id)
        self.free_blocks += request.block_ids
        request.block_ids, request.num_computed, request.is_new = [], 0, True
        self.finished.append(req_id)


def pooling_step(worker, prompts: dict[str, list[int]],  # type: ignore[no-untyped-def]
                 params: PoolingParams | dict[str, PoolingParams | None] | None = None,
                 ) -> ModelRunnerOutput:
    """One step of pooling requests as the engine core schedules them: each new, its whole
    prompt at once, no KV blocks. `params`: one for all (None: PoolingParams()) or per id."""
    def params_of(req_id: str) -> PoolingParams | None:
        if isinstance(params, dict):
            return params[req_id]
        return params or PoolingParams()

    new = [NewRequestData(req_id=req_id, prompt_token_ids=list(prompt),
                          sampling_params=SamplingParams(), block_ids=[],
                          pooling_params=params_of(req_id))
           for req_id, prompt in prompts.items()]
    return worker.execute_model(SchedulerOutput(
        scheduled_new_reqs=new, scheduled_cached_reqs=[],
        num_scheduled_tokens={req_id: len(prompt) for req_id, prompt in prompts.items()},
        finished_req_ids=[]))


def pooled_vectors(output: ModelRunnerOutput) -> dict[str, np.ndarray]:
    """The runner's float32 bytes back as vectors, by request id."""
    return {req_id: np.frombuffer(data, dtype=np.float32)
            for req_id, data in output.pooler_outputs.items()}
