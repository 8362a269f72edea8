"""Chat messages to prompt tokens through the chat template (front end).

The template is the request's `chat_template` (only with --trust-request-chat-template),
else --chat-template, else the model's. `chat_template_kwargs` become template
variables; `continue_final_message` renders without a generation prompt and cuts the
text right after the last message, so the model continues it; assistant `tool_calls` and
tool messages' `tool_call_id` reach the template as OpenAI sends them (a call's JSON
`arguments` parsed into a dict, as vLLM does, since templates iterate over them).
A template that fails is a 400 naming the template, never a 500.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.openai.chat_escape import escape_special_tokens
from gateway.frontend.openai.protocol import ChatCompletionRequest, ChatMessage
from gateway.frontend.openai.serving import ServingOptions

# Template variables the server sets itself; chat_template_kwargs may not replace them.
_RESERVED = frozenset({"messages", "add_generation_prompt"})


def chat_prompt_token_ids(body: ChatCompletionRequest, tokenizer: Any,
                          options: ServingOptions,
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The prompt of a chat request (`tools`: what the template sees as `tools`)."""
    if body.continue_final_message and body.add_generation_prompt \
            and "add_generation_prompt" in body.model_fields_set:
        raise OpenAIError(400, "continue_final_message and add_generation_prompt cannot "
                          "both be true.", param="continue_final_message")
    kwargs = dict(body.chat_template_kwargs or {})
    if tools is not None:
        kwargs["tools"] = tools
    if body.documents is not None:
        kwargs.setdefault("documents", body.documents)
    reserved = sorted(_RESERVED & kwargs.keys())
    if reserved:
        raise OpenAIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}.",
                          param="chat_template_kwargs")
    if body.chat_template is not None and not options.trust_request_chat_template:
        raise OpenAIError(400, "A chat_template in the request is refused: the server was "
                          "not started with --trust-request-chat-template.",
                          param="chat_template")
    return render_chat(body.messages, tokenizer,
                       template=body.chat_template or options.chat_template,
                       template_param="chat_template" if body.chat_template else "messages",
                       add_generation_prompt=(body.add_generation_prompt
                                              and not body.continue_final_message),
                       continue_final_message=body.continue_final_message, kwargs=kwargs,
                       add_special_tokens=body.add_special_tokens)


def render_chat(messages: list[ChatMessage], tokenizer: Any, *, template: str | None = None,
                template_param: str = "messages", add_generation_prompt: bool = True,
                continue_final_message: bool = False, kwargs: dict[str, Any] | None = None,
                add_special_tokens: bool = False) -> list[int]:
    """Render and tokenize (the template writes its own special tokens, so by default
    none are added)."""
    dicts = [message_dict(m) for m in messages]
    # Special-token strings typed in message text stay text (chat_escape.py).
    escaped = escape_special_tokens(tokenizer, dicts)
    try:
        text = tokenizer.apply_chat_template(escaped.messages,
                                             add_generation_prompt=add_generation_prompt,
                                             chat_template=template, **(kwargs or {}))
    except Exception as exc:  # a template is code: whatever it raises is the request's 400
        raise OpenAIError(400, f"The chat template ({_which(template, template_param)}) "
                          f"could not render these messages: {type(exc).__name__}: {exc}",
                          param=template_param) from exc
    if continue_final_message:
        text = _cut_after_final(text, escaped.messages[-1]["content"])
    token_ids: list[int] = escaped.encode(text, add_special_tokens=add_special_tokens)
    if not token_ids:
        raise OpenAIError(400, "The messages render to an empty prompt.", param="messages")
    return token_ids


def _which(template: str | None, param: str) -> str:
    if template is None:
        return "the model's"
    return "the request's chat_template" if param == "chat_template" else "--chat-template"


def _cut_after_final(text: str, final: str) -> str:
    end = text.rfind(final) if final else -1
    if end < 0:
        raise OpenAIError(400, "continue_final_message: the rendered prompt does not hold "
                          "the final message's content, so it cannot be continued.",
                          param="continue_final_message")
    return text[:end + len(final)]


def message_dict(message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template sees it: role, text content, tool calls."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(400, f"Content part of type {part.get('type')!r} is not "
                                  "supported; only 'text' parts are.", param="messages")
            texts.append(part["text"])
        content = "\n".join(texts)
    result: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        result["name"] = message.name
    if message.tool_calls is not None:
        result["tool_calls"] = [_parsed_arguments(call) for call in message.tool_calls]
    if message.tool_call_id is not None:
        result["tool_call_id"] = message.tool_call_id
    return result


def _parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            return call  # left as the client wrote it
        return {**call, "function": {**function, "arguments": arguments}}
    return call
