"""From an OpenAI request to what the engine takes: checks and `SamplingParams`.

Every refusal here is a 400 (or 404 for an unknown model) naming the parameter.
"""

from __future__ import annotations

from typing import Any, NoReturn

from gateway.entrypoints.errors import OpenAIError
from gateway.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from gateway.sampling_params import InvalidParameterError, SamplingParams

_LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a bias; vLLM clamps to it too


def check_model(requested: str | None, served: str) -> None:
    """A request may omit `model`; one that names another model is a 404."""
    if requested is not None and requested != served:
        raise OpenAIError(404, f"The model `{requested}` does not exist. This server serves "
                          f"`{served}`.", param="model", code="model_not_found")


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    """Every id must be in [0, vocab_size)."""
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise OpenAIError(400, f"Token id {token_id} is out of range for a vocabulary of "
                              f"{vocab_size} tokens.", param=param)


def check_unsupported(request: SamplingFields) -> None:
    """Refuse what OpenAI defines and this server cannot do, instead of ignoring it."""
    if request.stream_options is not None and not request.stream:
        _refuse("stream_options", "stream_options is only allowed with stream: true.")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(request, name) not in (None, 0, 0.0):
            _refuse(name, f"{name} is not supported by this server.")
    if request.repetition_penalty not in (None, 1.0):
        _refuse("repetition_penalty", "repetition_penalty is not supported by this server.")
    if isinstance(request, CompletionRequest):
        _check_completion_fields(request)
    if isinstance(request, ChatCompletionRequest):
        _check_chat_fields(request)


def _check_completion_fields(request: CompletionRequest) -> None:
    if request.logprobs is not None:
        _refuse("logprobs", "logprobs is not supported by this server.")
    if request.best_of not in (None, 1):
        _refuse("best_of", "best_of is not supported by this server.")
    if request.suffix:
        _refuse("suffix", "suffix is not supported by this server.")


def _check_chat_fields(request: ChatCompletionRequest) -> None:
    if request.logprobs or request.top_logprobs:
        _refuse("logprobs", "logprobs is not supported by this server.")


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int,
                       prompt_param: str, tokens_param: str = "max_tokens") -> int:
    """The completion length to allow: the request's, or what is left of the context.

    A prompt that leaves no room, or a request for more tokens than the context has left,
    is a 400 naming the numbers (OpenAI's wording).
    """
    if prompt_len >= max_model_len:
        raise OpenAIError(400, f"This model's maximum context length is {max_model_len} "
                          f"tokens. However, your prompt has {prompt_len} tokens, which "
                          "leaves no room for a completion. Please reduce the length of the "
                          "prompt.", param=prompt_param, code="context_length_exceeded")
    if requested is None:
        return max_model_len - prompt_len
    if requested >= 1 and prompt_len + requested > max_model_len:
        raise OpenAIError(400, f"This model's maximum context length is {max_model_len} "
                          f"tokens. However, you requested {prompt_len + requested} tokens "
                          f"({prompt_len} in the prompt, {requested} for the completion). "
                          f"Please reduce the length of the prompt or {tokens_param}.",
                          param=tokens_param, code="context_length_exceeded")
    return requested


def to_sampling_params(request: SamplingFields, max_tokens: int, vocab_size: int
                       ) -> SamplingParams:
    """Build the engine's `SamplingParams`; a bad value is a 400 naming it. Call
    `check_unsupported` first."""
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    stop_token_ids = list(request.stop_token_ids or [])
    check_token_ids(stop_token_ids, vocab_size, "stop_token_ids")
    try:
        return SamplingParams(
            n=request.n,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k,
            min_p=0.0 if request.min_p is None else request.min_p,
            seed=request.seed,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=request.ignore_eos,
            logit_bias=_logit_bias(request.logit_bias, vocab_size),
            extra_args=_extra_args(request),
        )
    except InvalidParameterError as exc:
        raise OpenAIError(400, str(exc), param=exc.param) from exc


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    result: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            # The key is not echoed: an error body never repeats client text.
            _refuse("logit_bias", "logit_bias keys must be token ids (integers written as "
                    "strings); a key is not one.")
        check_token_ids([token_id], vocab_size, "logit_bias")
        result[token_id] = max(-_LOGIT_BIAS_LIMIT, min(_LOGIT_BIAS_LIMIT, value))
    return result


def _extra_args(request: SamplingFields) -> dict[str, Any] | None:
    merged = {**(request.extra_args or {}), **(request.vllm_xargs or {})}
    return merged or None


def _refuse(param: str, message: str) -> NoReturn:
    raise OpenAIError(400, message, param=param)
