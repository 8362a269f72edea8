"""From an OpenAI request to what the engine takes: checks and `SamplingParams` (API-server
process).

Every refusal here is a 400 (or 404 for an unknown model) naming the parameter.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

from gateway.config import SchedulerConfig
from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from gateway.sampling_params import MAX_LOGPROBS, InvalidParameterError, SamplingParams

_LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a bias; vLLM clamps to it too
DEFAULT_MAX_N = 16  # the most choices one request may ask for (--max-n)
#: --max-seqs-per-request (a request's prompts x n, at most) is by default this many times
#: --max-num-seqs: a request may fill a few batches, each run in turn with other clients'.
SEQS_PER_REQUEST_PER_BATCH_SEQ = 4
DEFAULT_MAX_SEQS_PER_REQUEST = SEQS_PER_REQUEST_PER_BATCH_SEQ * SchedulerConfig().max_num_seqs
MIN_TEMPERATURE = 0.01  # vLLM's _MAX_TEMP: smaller positive temperatures are raised to it
MAX_XARGS_DEPTH = 32  # nesting of vllm_xargs; deeper is refused (it would exhaust the stack)


def check_model(requested: str | None, served: str) -> None:
    """A request may omit `model`; one that names another model is a 404."""
    if requested is not None and requested != served:
        raise OpenAIError(404, f"The model `{requested}` does not exist. This server serves "
                          f"`{served}`.", param="model", code="model_not_found")


def check_num_seqs(num_prompts: int, n: int, max_seqs_per_request: int,
                   max_num_queued_reqs: int | None = None) -> None:
    """A request runs its prompts x `n` sequences: past --max-seqs-per-request, or past
    --max-num-queued-reqs (it could never be admitted), a 400 naming the field and the cap."""
    limit, flag = max_seqs_per_request, "--max-seqs-per-request"
    if max_num_queued_reqs is not None and max_num_queued_reqs < limit:
        limit, flag = max_num_queued_reqs, "--max-num-queued-reqs"
    num_seqs = num_prompts * n
    if num_seqs <= limit:
        return
    _refuse("prompt" if n == 1 or num_prompts > limit else "n",
            f"The request asks for {num_prompts} prompt(s) x n {n} = {num_seqs} sequences; "
            f"this server runs at most {limit} per request ({flag} {limit}).")


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    """Every id must be in [0, vocab_size)."""
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise OpenAIError(400, f"Token id {token_id} is out of range for a vocabulary of "
                              f"{vocab_size} tokens.", param=param)


def check_unsupported(request: SamplingFields, max_n: int = DEFAULT_MAX_N) -> None:
    """Refuse what OpenAI defines and this server cannot do, instead of ignoring it."""
    if request.stream_options is not None and not request.stream:
        _refuse("stream_options", "stream_options is only allowed with stream: true.")
    if not 1 <= request.n <= max_n:
        _refuse("n", f"n must be between 1 and {max_n} (this server's --max-n), got "
                f"{request.n}.")
    _check_logprobs("prompt_logprobs", request.prompt_logprobs)
    _check_refused(request)
    if isinstance(request, CompletionRequest):
        _check_completion_fields(request)
    if isinstance(request, ChatCompletionRequest):
        _check_chat_fields(request)


#: Fields OpenAI or vLLM define that this server cannot honour: refused (400) unless left
#: at a value that asks for nothing: name -> (the values that ask nothing, why).
REFUSED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1.0, 1), "length_penalty applies to beam search, not supported"),
    "logits_processors": ((None, []), "per-request logits processors are not supported; "
                          "start the server with --logits-processors"),
    "cache_salt": ((None,), "cache_salt is not supported"),
    "kv_transfer_params": ((None,), "KV transfer (disaggregated serving) is not supported"),
    "prompt_embeds": ((None,), "prompt embeddings are not supported; send text or ids"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only the text modality is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "functions": ((None, []), "function calling is not supported by this server"),
    "function_call": ((None, "none", "auto"), "function calling is not supported by this "
                      "server"),
    "store": ((None, False), "stored completions are not supported"),
    "service_tier": ((None, "auto", "default"), "only the default service tier exists"),
    "verbosity": ((None,), "verbosity is not supported"),
    "mm_processor_kwargs": ((None, {}), "this model takes no multimodal input"),
}


def _check_refused(request: SamplingFields) -> None:
    for name, (harmless, why) in REFUSED_FIELDS.items():
        if not hasattr(request, name):
            continue
        value = getattr(request, name)
        if not any(value == ok and type(value) is type(ok) or value is ok
                   for ok in harmless):
            _refuse(name, f"{name}: {why}.")


def _check_logprobs(param: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        _refuse(param, f"{param} must be between 0 and {MAX_LOGPROBS}, got {value}.")


def _check_completion_fields(request: CompletionRequest) -> None:
    _check_logprobs("logprobs", request.logprobs)
    if request.best_of is not None and request.best_of != request.n:
        _refuse("best_of", f"best_of must equal n ({request.n}) on this server: every "
                "sample is returned, none is chosen among more.")
    if request.suffix:
        _refuse("suffix", "suffix is not supported by this server.")


def _check_chat_fields(request: ChatCompletionRequest) -> None:
    _check_logprobs("top_logprobs", request.top_logprobs)
    if request.best_of is not None and request.best_of != request.n:
        _refuse("best_of", f"best_of must equal n ({request.n}) on this server.")
    if request.echo:
        _refuse("echo", "echo is not supported on chat completions.")
    if request.top_logprobs is not None and not request.logprobs:
        _refuse("top_logprobs", "top_logprobs needs logprobs: true.")


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


def to_sampling_params(request: SamplingFields, max_tokens: int, vocab_size: int, *,
                       tokenizer: Any = None, defaults: dict[str, float] | None = None,
                       logprobs: int | None = None, prompt_logprobs: int | None = None,
                       ) -> SamplingParams:
    """Build the engine's `SamplingParams`; a bad value is a 400 naming it. Call
    `check_unsupported` first. `defaults`: the model's sampling defaults (its generation
    config), used where the request leaves a field out; `tokenizer` tokenizes bad_words."""
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    stop_token_ids = list(request.stop_token_ids or [])
    check_token_ids(stop_token_ids, vocab_size, "stop_token_ids")
    allowed = request.allowed_token_ids
    if allowed is not None:
        check_token_ids(allowed, vocab_size, "allowed_token_ids")
    sampling = _with_defaults(request, defaults or {})
    try:
        return SamplingParams(
            n=1, **sampling, seed=request.seed, max_tokens=max_tokens,
            min_tokens=request.min_tokens, stop=stop, stop_token_ids=stop_token_ids,
            ignore_eos=request.ignore_eos,
            logit_bias=_logit_bias(request.logit_bias, vocab_size),
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            bad_words_token_ids=_bad_words(request.bad_words, tokenizer),
            allowed_token_ids=None if allowed is None else list(allowed),
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            extra_args=_extra_args(request),
            max_queue_time=request.max_queue_time, priority=request.priority,
        )
    except InvalidParameterError as exc:
        raise OpenAIError(400, str(exc), param=exc.param) from exc


#: Sampling fields a model's generation config may default, and the API's own default.
SAMPLING_DEFAULTS: dict[str, float] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0}


def _with_defaults(request: SamplingFields, defaults: dict[str, float]) -> dict[str, Any]:
    """Each sampling field: the request's value, else the model's default, else the API's."""
    values: dict[str, Any] = {}
    for name, api_default in SAMPLING_DEFAULTS.items():
        value = getattr(request, name)
        values[name] = value if value is not None else defaults.get(name, api_default)
    values["top_k"] = int(values["top_k"]) or None
    values["temperature"] = _temperature(values["temperature"])
    return values


def _bad_words(words: list[str] | None, tokenizer: Any) -> list[list[int]]:
    """Each bad word as token ids, also as it tokenizes after a space (vLLM does both)."""
    if not words:
        return []
    if tokenizer is None:
        raise ValueError("bad_words needs the tokenizer")
    result: list[list[int]] = []
    for word in words:
        if not word.strip():
            _refuse("bad_words", "bad words must not be empty or blank.")
        for text in (word, " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in result:
                result.append(ids)
    return result


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
        if not math.isfinite(value):  # min/max below would turn NaN into the limit
            _refuse("logit_bias", "logit_bias values must be finite numbers.")
        result[token_id] = max(-_LOGIT_BIAS_LIMIT, min(_LOGIT_BIAS_LIMIT, value))
    return result


def _extra_args(request: SamplingFields) -> dict[str, Any] | None:
    merged = {**(request.extra_args or {}), **(request.vllm_xargs or {})}
    if nesting_depth(merged) > MAX_XARGS_DEPTH:
        _refuse("vllm_xargs", f"vllm_xargs may nest at most {MAX_XARGS_DEPTH} levels deep.")
    return merged or None


def nesting_depth(value: Any) -> int:
    """How deeply lists and dicts nest in `value` (iterative: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else \
            item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _temperature(value: float | None) -> float:
    """vLLM's rule: a temperature above 0 but below 0.01 is raised to 0.01 (dividing the
    logits by less overflows them)."""
    if value is None:
        return 1.0
    return MIN_TEMPERATURE if 0.0 < value < MIN_TEMPERATURE else value


def _refuse(param: str, message: str) -> NoReturn:
    raise OpenAIError(400, message, param=param)
