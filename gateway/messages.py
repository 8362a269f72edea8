"""The message types that cross a process boundary: the only vocabulary the front end, the
engine core and the workers share. All are msgspec Structs, encoded as msgpack."""

from __future__ import annotations

import msgspec

from gateway.sampling_params import SamplingParams

__all__ = ["SamplingParams", "NewRequestData", "CachedRequestData", "SchedulerOutput",
           "ModelRunnerOutput"]


# --------------------------------------------------------------- engine core -> worker
class NewRequestData(msgspec.Struct, kw_only=True):
    """A request the worker has not seen (or sees again after preemption by recompute)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]  # KV-cache blocks held so far, in order
    # Tokens generated before a preemption; the worker recomputes prompt + these.
    output_token_ids: list[int] = msgspec.field(default_factory=list)
    num_computed_tokens: int = 0


class CachedRequestData(msgspec.Struct, kw_only=True):
    """A request the worker already holds, continuing this step."""

    req_id: str
    new_block_ids: list[int]  # blocks appended since the last step
    num_computed_tokens: int  # tokens whose KV is already cached


class SchedulerOutput(msgspec.Struct, kw_only=True):
    """What to run in one step. Requests absent from `num_scheduled_tokens` wait."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step
    finished_req_ids: list[str]  # finished, aborted or preempted since the last step


class ModelRunnerOutput(msgspec.Struct, kw_only=True):
    """Sampled tokens of one step, for requests that finished their prompt this step or
    earlier; a request still part-way through a chunked prefill has no entry."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    # Requests whose logits processor failed this step: req_id -> error text.
    errors: dict[str, str] = msgspec.field(default_factory=dict)
