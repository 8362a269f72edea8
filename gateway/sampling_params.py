"""Sampling parameters: the one request vocabulary shared by every process.

A `SamplingParams` travels from the front end to the engine core and the workers as
msgpack (it is a msgspec Struct), so it holds plain data only.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from gateway.lora_request import LoRARequest
from gateway.structured_outputs_params import StructuredOutputsParams


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How one request samples its tokens. Defaults follow the OpenAI API and vLLM."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # None (or 0 / -1 from a client): no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None
    # Log-probabilities, from the model's raw distribution (before any sampling change).
    logprobs: int | None = None  # per sampled token: its own and the top N (0: its own)
    prompt_logprobs: int | None = None  # per prompt token after the first: the same
    # Penalties (vLLM's and OpenAI's meaning): presence and frequency over the output,
    # repetition over prompt and output (a logit > 0 divided by it, one < 0 multiplied).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    #: Token sequences that are never completed: the last token of each is masked when
    #: the output ends with the rest (the front end tokenizes `bad_words` into these).
    bad_words_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    allowed_token_ids: list[int] | None = None  # None: every token
    # Detokenization (front end)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Free-form per-request arguments; logits-processor plugins read theirs from here.
    extra_args: dict[str, Any] | None = None
    # A grammar the output must follow (JSON schema, regex, choice, EBNF); None: free text.
    structured_outputs: StructuredOutputsParams | None = None
    #: Scheduling, not sampling (the engine core reads it): seconds this request may wait
    #: in the queue before it is refused as "queue_timeout"; the server's
    #: --max-queue-time still applies when it is shorter. None: the server's limit only.
    max_queue_time: float | None = None
    #: Scheduling: with --scheduling-policy priority, a lower value starts first and is
    #: preempted last (vLLM's request field); any other policy takes only 0.
    priority: int = 0
    #: The LoRA adapter the request runs (the front end sets it from `model`); None: the
    #: base model. The engine core schedules by it and the worker applies it.
    lora_request: LoRARequest | None = None

    def __post_init__(self) -> None:
        if self.top_k is not None and self.top_k <= 0:
            self.top_k = None
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def validate(self) -> None:
        """Raise ValueError naming the first bad parameter."""
        _check(self.n == 1, "n", f"one engine request samples once (n=1), got {self.n}")
        _check(_finite(self.temperature) and self.temperature >= 0.0, "temperature",
               f"temperature must be a finite number >= 0, got {self.temperature}")
        _check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
               f"top_p must be in (0, 1], got {self.top_p}")
        _check(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p",
               f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens",
               f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for token_id, bias in (self.logit_bias or {}).items():
            _check(_finite(bias), "logit_bias", f"logit_bias[{token_id}] must be finite")
        _check(all(s for s in self.stop), "stop", "stop strings must not be empty")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or 0 <= value <= MAX_LOGPROBS, name,
                   f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2.0 <= value <= 2.0, name,
                   f"{name} must be in [-2, 2], got {value}")
        _check(_finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
               "repetition_penalty",
               f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        _check(self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
               "allowed_token_ids", "allowed_token_ids must not be empty")
        _check(all(words for words in self.bad_words_token_ids), "bad_words",
               "bad words must not be empty")
        for name in ("seed", "top_k", "max_tokens", "min_tokens", "priority"):
            value = getattr(self, name)
            _check(value is None or _INT64_MIN <= value <= _INT64_MAX, name,
                   f"{name} must fit in a signed 64-bit integer")
        _check(self.max_queue_time is None
               or (_finite(self.max_queue_time) and self.max_queue_time > 0), "max_queue_time",
               f"max_queue_time must be a finite number of seconds > 0, got "
               f"{self.max_queue_time}")
        _check(_fits_int64(self.extra_args), "extra_args",
               "extra_args (vllm_xargs) must hold only integers that fit in 64 bits")


#: The most top log-probabilities a request may ask for (vLLM's default `max_logprobs`).
MAX_LOGPROBS = 20


class InvalidParameterError(ValueError):
    """A request parameter is invalid; `param` names it (the HTTP layer answers 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameterError(param, message)


# Requests cross processes as msgpack, whose integers are 64-bit: a larger one from a client
# is a 400, not a failure to encode (which was a 500).
_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def _fits_int64(value: Any) -> bool:
    """Whether every int in a JSON-like value (dicts, lists) fits in a signed 64 bits."""
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, int):
        return _INT64_MIN <= value <= _INT64_MAX
    if isinstance(value, dict):
        return all(_fits_int64(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return all(_fits_int64(item) for item in value)
    return True


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
