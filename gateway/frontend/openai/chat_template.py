"""Chat messages to prompt tokens through the chat template (API-server process).

The template is the request's `chat_template` (only with --trust-request-chat-template),
else --chat-template, else the model's; `chat_template_kwargs` become template variables,
and `continue_final_message` renders without a generation prompt and cuts the text right
after the last message. A template that fails is a 400 naming the template, never a 500.
Every string the client sends to the template is escaped first, so none becomes a special
token (chat_escape.py); a template's text is limited to what the context could hold, and
a request's own template renders in a helper process with a time limit
(request_templates.py).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.openai.chat_escape import escape_special_tokens
from gateway.frontend.openai.protocol import ChatCompletionRequest, ChatMessage
from gateway.frontend.openai.request_templates import render_request_template
from gateway.frontend.openai.sampling import nesting_depth
from gateway.frontend.openai.serving import ServingOptions
from gateway.template_sandbox import DEFAULT_MAX_CHARS, TemplateOutputError, render_template

# Template variables the server sets itself; chat_template_kwargs may not replace them.
_RESERVED = frozenset({"messages", "add_generation_prompt"})
#: Nesting of the template variables a client sends (tools, documents, kwargs).
MAX_VARIABLE_DEPTH = 64


def chat_prompt_token_ids(body: ChatCompletionRequest, tokenizer: Any,
                          options: ServingOptions,
                          tools: list[dict[str, Any]] | None = None,
                          max_chars: int = DEFAULT_MAX_CHARS) -> list[int]:
    """The prompt of a chat request (`tools`: what the template sees as `tools`;
    `max_chars`: the most text the template may write)."""
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
    for param in ("tools", "documents", "chat_template_kwargs"):
        if nesting_depth(getattr(body, param)) > MAX_VARIABLE_DEPTH:
            raise OpenAIError(400, f"{param} may nest at most {MAX_VARIABLE_DEPTH} levels "
                              "deep.", param=param)
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
                       add_special_tokens=body.add_special_tokens, max_chars=max_chars,
                       render_timeout_s=options.chat_template_render_timeout_s)


def render_chat(messages: list[ChatMessage], tokenizer: Any, *, template: str | None = None,
                template_param: str = "messages", add_generation_prompt: bool = True,
                continue_final_message: bool = False, kwargs: dict[str, Any] | None = None,
                add_special_tokens: bool = False, max_chars: int = DEFAULT_MAX_CHARS,
                render_timeout_s: float | None = None) -> list[int]:
    """Render and tokenize (the template writes its own special tokens, so by default
    none are added). `template_param` "chat_template": `template` is the request's own,
    rendered in a helper process within `render_timeout_s`."""
    dicts = [message_dict(m) for m in messages]
    # Special-token strings typed anywhere by the client stay text (chat_escape.py).
    escaped = escape_special_tokens(tokenizer, dicts, kwargs)
    variables = tokenizer.template_variables(
        escaped.messages, add_generation_prompt=add_generation_prompt, **escaped.variables)
    try:
        source = tokenizer.template_source(template)
        if template_param == "chat_template":
            text = render_request_template(source, variables, max_chars, render_timeout_s)
        else:
            text = render_template(source, variables, max_chars)
    except OpenAIError:
        raise
    except TemplateOutputError:
        raise OpenAIError(400, f"The chat template ({_which(template, template_param)}) "
                          f"writes more than {max_chars} characters for these messages, more "
                          "than the context can hold.", param=template_param) from None
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
    """A message as the chat template sees it: role, text content, tool calls. Assistant
    `tool_calls` and a tool message's `tool_call_id` reach the template as OpenAI sends them,
    a call's JSON `arguments` parsed into a dict (as vLLM does: templates iterate over it)."""
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
        except (ValueError, RecursionError):
            return call  # left as the client wrote it
        return {**call, "function": {**function, "arguments": arguments}}
    return call
