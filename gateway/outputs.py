"""What a caller of the engine client receives: `RequestOutput` from `generate`,
`PoolingRequestOutput` from `encode` (vLLM's vllm/outputs.py, same names and shapes).

Shared: made in the front end from the engine core's outputs, read by the routes and by
endpoint plugins (docs/plugins.md, "EngineClient"). Torch is never imported here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gateway.messages import EngineCoreOutput, TokenLogprobs


@dataclass
class RequestOutput:
    """What a caller of `EngineClient.generate` receives, once per step with new tokens."""

    request_id: str
    prompt_token_ids: list[int]
    text: str  # the whole output so far (stop strings removed)
    delta_text: str  # new text since the previous RequestOutput
    token_ids: list[int]  # the whole output so far
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    error: str | None = None
    error_kind: str | None = None  # "invalid_request" (HTTP 400) | "internal" (500)
    error_param: str | None = None
    # Asked-for log-probabilities (None when not asked): those of every output token so
    # far, of this output's new tokens, and of the prompt (the first token has none).
    logprobs: list[TokenLogprobs] | None = None
    delta_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class PoolingOutput:
    """The pooled vector of one prompt (vLLM's `PoolingOutput`; `data` is a float32
    numpy array here, where vLLM has a torch tensor)."""

    data: np.ndarray


@dataclass
class PoolingRequestOutput:
    """What `EngineClient.encode` returns: one prompt's pooled vector (vLLM's shape:
    `output.outputs.data`), or the error that ended it."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    finish_reason: str | None = "stop"  # "stop" | "abort" | "error"
    error: str | None = None
    error_kind: str | None = None  # "invalid_request" (HTTP 400) | "internal" (500)
    error_param: str | None = None

    @classmethod
    def from_engine(cls, output: EngineCoreOutput,
                    prompt_token_ids: list[int]) -> PoolingRequestOutput:
        data = (np.frombuffer(output.pooling_output, dtype=np.float32)
                if output.pooling_output is not None else np.empty(0, dtype=np.float32))
        return cls(output.request_id, prompt_token_ids, PoolingOutput(data), True,
                   output.finish_reason, output.error, output.error_kind, output.error_param)
