"""Request models of the OpenAI-compatible routes (pydantic, validated by FastAPI in the
API-server process).

Fields follow the OpenAI API plus vLLM's extras (`top_k`, `min_p`, `min_tokens`,
`ignore_eos`, `stop_token_ids`, `vllm_xargs`, ...). Every field either defines is declared
here: honoured, or refused with a 400 naming it when set to what this server cannot do
(`sampling.check_unsupported`). A field neither defines is kept aside, logged once and
named in the response's X-Ignored-Fields header (`ignored_fields.py`). Responses are
plain dicts.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)


class OpenAIBaseModel(BaseModel):
    # strict: a value must have its documented JSON type, as OpenAI requires ("5" is not an
    # integer, true is not 1); lax pydantic accepted what /openapi.json says is invalid.
    # extra="allow": a field nobody defines is kept aside (`model_extra`), so the route
    # can log it and name it in X-Ignored-Fields instead of dropping it unseen.
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` object: exactly one constraint (see
    docs/structured-outputs.md). Unknown keys are refused, not ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)
    # "json" on the wire (the name would shadow pydantic's BaseModel.json)
    json_schema: str | dict[str, Any] | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class SamplingFields(OpenAIBaseModel):
    """The sampling fields completions and chat share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    #: Keep only the last this many prompt tokens (-1: as many as the context allows).
    truncate_prompt_tokens: int | None = None
    #: Log-probabilities of the prompt's tokens, with the top N of each (vLLM's extra).
    prompt_logprobs: int | None = None
    #: Logprob tokens written "token_id:N" instead of their text (vLLM's extra).
    return_tokens_as_token_ids: bool = False
    #: Answer with the token ids too: `prompt_token_ids`, and each choice's `token_ids`.
    return_token_ids: bool = False
    #: The response's id is built from this one (vLLM's).
    request_id: str | None = None
    #: Seconds this request may wait in the engine's queue before it is refused with 503
    #: (the gateway's own field; the server's --max-queue-time applies when shorter).
    max_queue_time: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    #: Free-form arguments for logits-processor plugins (vLLM's name, and the params' name).
    vllm_xargs: dict[str, Any] | None = None
    extra_args: dict[str, Any] | None = None
    #: vLLM's: with --scheduling-policy priority, lower values start first and are
    #: preempted last; otherwise only 0 is accepted (the engine says so).
    priority: int = 0
    # Defined by vLLM, refused unless left at their default (see sampling.REFUSED_FIELDS).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    logits_processors: list[Any] | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # Structured outputs (vLLM's object, and its older guided_* aliases)
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    #: A string, a list of token ids, or a list of either (one choice per prompt).
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    # vLLM's extras
    add_special_tokens: bool = True
    prompt_embeds: Any = None  # refused: prompts are text or token ids here
    response_format: dict[str, Any] | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    #: A string, or a list of content parts of which only {"type": "text"} is supported.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    #: An assistant's earlier tool calls, and a tool message's answer to one of them:
    #: passed to the chat template as they are.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    # vLLM's extras
    add_generation_prompt: bool = True
    #: The last message (an assistant's) is continued: no generation prompt is added.
    continue_final_message: bool = False
    #: Extra variables for the chat template (e.g. enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    #: A chat template for this request instead of the server's.
    chat_template: str | None = None
    #: Documents for retrieval-augmented templates: passed to the template as `documents`.
    documents: list[dict[str, Any]] | None = None
    add_special_tokens: bool = False
    # Defined by OpenAI or vLLM, refused unless left at their default.
    echo: bool = False
    best_of: int | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    store: bool | None = None
    service_tier: str | None = None
    verbosity: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    # Informational (OpenAI's); accepted, and nothing here depends on them.
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses (OpenAI's Responses API, as vLLM serves it). `input` items and
    `tools` are checked item by item in responses_input.py, so a bad one is named."""

    model: str | None = None
    #: A user message's text, or a list of items (messages, function calls and their
    #: outputs, reasoning).
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = True
    #: {"format": {"type": "text" | "json_schema" | "json_object", ...}}.
    text: dict[str, Any] | None = None
    #: {"effort": ..., "summary": ...}: the effort reaches the chat template.
    reasoning: dict[str, Any] | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    stream: bool | None = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Defined by OpenAI, refused unless left at their default (responses_input.py).
    background: bool | None = False
    include: list[str] | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    conversation: Any = None
    service_tier: str | None = "auto"
    top_logprobs: int | None = 0
    truncation: str | None = "disabled"
    stream_options: dict[str, Any] | None = None
    # Informational (OpenAI's); accepted, and nothing here depends on them.
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extras
    top_k: int | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    enable_response_messages: bool = False
    previous_input_messages: list[Any] | None = None


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize: exactly one of `prompt` and `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    #: Default: True for a prompt, False for messages (the chat template adds its own).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(OpenAIBaseModel):
    """POST /v1/embeddings (and /pooling without an IO processor)."""

    model: str | None = None
    #: A string, a list of strings, a list of token ids, or a list of token-id lists.
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    #: Fewer values than the model gives: Matryoshka models only.
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras
    #: Longer inputs are cut to this many tokens (-1: the model's limit) instead of refused.
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    #: L2-normalise (None: the model's own choice).
    normalize: bool | None = None

    @field_validator("input", mode="wrap")
    @classmethod
    def _one_input_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler,
                         info: ValidationInfo) -> Any:
        """One clear message instead of one per member of the union."""
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("must be a string, a list of strings, a list of token ids, or "
                             "a list of token-id lists") from None


class PoolingRequest(EmbeddingRequest):
    """POST /pooling: `input` as for embeddings, or, when the server runs an IO processor,
    `data` for it to parse (then `input` is not used)."""

    input: str | list[str] | list[int] | list[list[int]] | None = None  # type: ignore[assignment]
    data: Any = None
