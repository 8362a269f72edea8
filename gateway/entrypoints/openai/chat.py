"""POST /v1/chat/completions (task `generate`): messages through the model's chat template,
the assistant's reply out, whole or streamed as SSE."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import jinja2
from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.engine.client import RequestOutput
from gateway.entrypoints.errors import OpenAIError
from gateway.entrypoints.openai.chat_output import AnswerParser, MessageStream, final_message
from gateway.entrypoints.openai.chat_tools import prepare_chat_answer
from gateway.entrypoints.openai.generation import (
    STREAM_RESPONSES,
    SSEResponse,
    generate_to_end,
    open_stream,
    sse_body,
    usage_of,
)
from gateway.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from gateway.entrypoints.openai.sampling import (
    check_model,
    check_unsupported,
    resolve_max_tokens,
    to_sampling_params,
)
from gateway.entrypoints.responses import JSONResponse

router = APIRouter()


@router.post("/v1/chat/completions", responses=STREAM_RESPONSES)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI's chat completions API (n=1, text content only)."""
    engine_client = request.app.state.engine_client
    check_model(body.model, engine_client.model_name)
    check_unsupported(body)
    tokenizer = engine_client.tokenizer
    answer = prepare_chat_answer(body, getattr(request.app.state, "chat_parsers", None))
    prompt_token_ids = chat_prompt_token_ids(body.messages, tokenizer,
                                             add_generation_prompt=body.add_generation_prompt,
                                             tools=answer.template_tools)
    tokens_param = "max_tokens" if body.max_completion_tokens is None \
        else "max_completion_tokens"
    max_tokens = resolve_max_tokens(getattr(body, tokens_param), len(prompt_token_ids),
                                    engine_client.max_model_len, "messages", tokens_param)
    params = to_sampling_params(body, max_tokens, tokenizer.vocab_size)
    params.structured_outputs = answer.structured_outputs
    parser = AnswerParser(answer.plan, answer.parsers, tokenizer)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    header = {"id": request_id, "created": int(time.time()), "model": engine_client.model_name}
    if body.stream:
        outputs = await open_stream(engine_client, request, prompt_token_ids, params,
                                    request_id)
        options = body.stream_options
        return SSEResponse(sse_body(_chunks(
            outputs, header, MessageStream(parser),
            include_usage=bool(options and options.include_usage),
            continuous_usage=bool(options and options.continuous_usage_stats))))
    final = await generate_to_end(engine_client, request, prompt_token_ids, params,
                                  request_id)
    message, finish_reason = final_message(parser, final.text, final.finish_reason)
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason,
              "stop_reason": final.stop_reason}
    return JSONResponse({**header, "object": "chat.completion", "choices": [choice],
                         "usage": usage_of(final)})


def chat_prompt_token_ids(messages: list[ChatMessage], tokenizer: Any, *,
                          add_generation_prompt: bool = True,
                          add_special_tokens: bool = False,
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Render `messages` (and the `tools`, for a template that shows them) with the model's
    chat template and tokenize the result (the template writes its own special tokens, so
    by default none are added)."""
    extra = {} if tools is None else {"tools": tools}
    try:
        text = tokenizer.apply_chat_template([message_dict(m) for m in messages],
                                             add_generation_prompt=add_generation_prompt,
                                             **extra)
    except (jinja2.TemplateError, ValueError) as exc:
        raise OpenAIError(400, f"The chat template could not render these messages: {exc}",
                          param="messages") from exc
    token_ids: list[int] = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not token_ids:
        raise OpenAIError(400, "The messages render to an empty prompt.", param="messages")
    return token_ids


def message_dict(message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template sees it: role and text content."""
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
        result["tool_calls"] = message.tool_calls
    if message.tool_call_id is not None:
        result["tool_call_id"] = message.tool_call_id
    return result


def _chunk(header: dict[str, Any], delta: dict[str, Any], finish_reason: str | None,
           stop_reason: str | int | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return {**header, "object": "chat.completion.chunk", "choices": [choice]}


async def _chunks(outputs: AsyncGenerator[RequestOutput, None], header: dict[str, Any],
                  stream: MessageStream, *, include_usage: bool, continuous_usage: bool
                  ) -> AsyncGenerator[dict[str, Any], None]:
    usage_field: dict[str, Any] = {"usage": None} if include_usage else {}
    last: RequestOutput | None = None
    async with aclosing(outputs):
        yield {**_chunk(header, {"role": "assistant", "content": ""}, None), **usage_field}
        async for output in outputs:
            last = output
            if not (output.delta_text or output.finished):
                continue
            deltas = stream.feed(output.delta_text, output.finished)
            if output.finished:  # the finish reason rides on the last delta
                deltas = deltas or [{}]
            for i, delta in enumerate(deltas):
                is_last = output.finished and i == len(deltas) - 1
                chunk = _chunk(header, delta,
                               stream.finish_reason(output.finish_reason) if is_last else None,
                               output.stop_reason)
                if include_usage:
                    chunk["usage"] = usage_of(output) if continuous_usage else None
                yield chunk
    if include_usage and last is not None:
        yield {**header, "object": "chat.completion.chunk", "choices": [],
               "usage": usage_of(last)}
