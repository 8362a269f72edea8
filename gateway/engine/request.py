"""A request as the engine core tracks it."""

from __future__ import annotations

import enum

from gateway.messages import EngineCoreRequest
from gateway.pooling_params import PoolingParams
from gateway.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Request:
    def __init__(self, request: EngineCoreRequest, max_model_len: int) -> None:
        self.request_id = request.request_id
        self.prompt_token_ids = request.prompt_token_ids
        self.sampling_params: SamplingParams = request.sampling_params
        # Set for a pooling request: it computes its whole prompt in one step and ends.
        self.pooling_params: PoolingParams | None = request.pooling_params
        self.arrival_time = request.arrival_time
        self.sibling_started = request.sibling_started
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache (or being computed)
        # --async-scheduling: tokens sampled by steps still in flight, not known yet; the
        # next step may compute the first of them (the worker fills its id in itself).
        self.num_output_placeholders = 0
        self.block_ids: list[int] = []
        # Prefix caching: the chained hashes of its full blocks (computed as needed), how
        # many of its held blocks are registered in the cache, and what else its KV
        # depends on (a LoRA adapter or a cache salt, once requests carry one).
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0
        self.lora_request = request.sampling_params.lora_request
        self.cache_extra_key: bytes | None = None if self.lora_request is None else \
            f"lora\0{self.lora_request.lora_int_id}\0{self.lora_request.lora_path}".encode()
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.is_new_to_worker = True  # next schedule sends it as NewRequestData
        # Speculative decoding: draft tokens proposed after the last step, verified in
        # the next one (dropped when it is preempted or cannot fit them).
        self.spec_token_ids: list[int] = []
        self.can_speculate = False  # set by the engine core (ngram_proposer.can_speculate)
        # Stats timestamps (time.time()); set only while the engine collects stats.
        self.scheduled_time: float | None = None  # first scheduled
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        params = request.sampling_params
        room = max_model_len - len(request.prompt_token_ids)
        self.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens + self.num_output_placeholders - self.num_computed_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Prompt + output tokens [start, end)."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]
