"""POST /v1/chat/completions (task `generate`; API-server process): messages (and tools) through
the chat template, `n` assistant replies out, whole or streamed as SSE (chunks of the choices
interleaved, each with its `index`); each reply's tool calls and reasoning are parsed out of its
text (chat_output.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.frontend.http.json_body import JSONBodyRoute
from gateway.frontend.http.responses import JSONResponse
from gateway.frontend.openai import logprobs as lp
from gateway.frontend.openai.chat_output import (
    AnswerParser,
    MessageStream,
    adjust_request,
    final_message,
)
from gateway.frontend.openai.chat_parsers import ChatParsers
from gateway.frontend.openai.chat_template import chat_prompt_token_ids
from gateway.frontend.openai.chat_tools import ChatAnswerSetup, prepare_chat_answer
from gateway.frontend.openai.fanout import Choice, open_streams, plan_choices, run_to_end
from gateway.frontend.openai.generation import STREAM_RESPONSES, SSEResponse, sse_body
from gateway.frontend.openai.ignored_fields import report_ignored
from gateway.frontend.openai.lora import served_name
from gateway.frontend.openai.protocol import ChatCompletionRequest
from gateway.frontend.openai.request_templates import off_loop_for_request_template
from gateway.frontend.openai.sampling import (
    check_num_seqs,
    check_unsupported,
    resolve_max_tokens,
    to_sampling_params,
)
from gateway.frontend.openai.structured_output_limits import SpecLimits
from gateway.frontend.prompt_work import MAX_CHARS_PER_TOKEN, check_text_length, off_loop
from gateway.frontend.server_state import ServerState, server_state
from gateway.outputs import RequestOutput
from gateway.sampling_params import SamplingParams

router = APIRouter(route_class=JSONBodyRoute)
ROUTE = "/v1/chat/completions"


@dataclass
class ChatRun:
    """A chat request made ready for the engine: its answer's parsers and constraint, its
    prompt and its sampling parameters (the request as the tool parser adjusted it)."""

    body: ChatCompletionRequest
    answer: ChatAnswerSetup
    prompt_token_ids: list[int]
    params: SamplingParams


async def prepare_chat_run(body: ChatCompletionRequest, state: ServerState, *,
                           prompt_param: str = "messages",
                           tokens_param: str | None = None) -> ChatRun:
    """Check a chat request and render its prompt (400s naming the field; `prompt_param`
    and `tokens_param` name the prompt and the length field in them)."""
    engine_client, options = state.engine_client, state.serving_options
    lora = await state.lora_adapters.resolve(body.model)
    check_unsupported(body, options.max_n)
    check_num_seqs(1, body.n, options.max_seqs_per_request, options.max_num_queued_reqs)
    tokenizer = engine_client.tokenizer
    # Walks of client data that grow with it (text lengths, a schema's enum values): off
    # the loop, where a 100,000-value enum no longer holds every stream still.
    answer = await off_loop(_checked_answer, body, engine_client.max_model_len,
                            state.chat_parsers, options.spec_limits, prompt_param)
    # A request's own template waits for its helper in threads of its own.
    render = off_loop if body.chat_template is None else off_loop_for_request_template
    prompt_token_ids = await render(chat_prompt_token_ids, body, tokenizer, options,
                                    tools=answer.template_tools,
                                    max_chars=MAX_CHARS_PER_TOKEN * engine_client.max_model_len)
    if tokens_param is None:
        tokens_param = "max_tokens" if body.max_completion_tokens is None \
            else "max_completion_tokens"
    requested = body.max_tokens if body.max_completion_tokens is None \
        else body.max_completion_tokens
    max_tokens = resolve_max_tokens(requested, len(prompt_token_ids),
                                    engine_client.max_model_len, prompt_param, tokens_param)
    body = adjust_request(body, answer.plan, answer.parsers, tokenizer)
    params = to_sampling_params(
        body, max_tokens, tokenizer.vocab_size, tokenizer=tokenizer,
        defaults=options.sampling_defaults,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None)
    params.structured_outputs = answer.structured_outputs
    params.lora_request = lora
    return ChatRun(body, answer, prompt_token_ids, params)


@router.post(ROUTE, responses=STREAM_RESPONSES)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI's chat completions API (text content)."""
    state = server_state(request)
    engine_client = state.engine_client
    tokenizer = engine_client.tokenizer
    run = await prepare_chat_run(body, state)
    body, answer, prompt_token_ids = run.body, run.answer, run.prompt_token_ids
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    choices = plan_choices(request_id, [prompt_token_ids], [run.params], body.n)
    response_id = f"chatcmpl-{body.request_id}" if body.request_id else request_id
    header = {"id": response_id, "created": int(time.time()),
              "model": served_name(run.params, engine_client.model_name)}
    text_of = lp.TokenText(tokenizer, body.return_tokens_as_token_ids)
    if body.stream:
        outputs = await open_streams(engine_client, request, choices)
        stream = body.stream_options
        streams = [MessageStream(AnswerParser(answer.plan, answer.parsers, tokenizer))
                   for _ in choices]
        return report_ignored(body, SSEResponse(sse_body(_chunks(
            outputs, header, body, choices, text_of, streams,
            include_usage=bool(stream and stream.include_usage),
            continuous_usage=bool(stream and stream.continuous_usage_stats)))), ROUTE)
    finals = await run_to_end(engine_client, request, choices)
    result = []
    for c, final in zip(choices, finals):
        parser = AnswerParser(answer.plan, answer.parsers, tokenizer)
        message, finish_reason = final_message(parser, final.text, final.finish_reason)
        result.append({
            "index": c.index, "message": message,
            "logprobs": _logprobs(body, text_of, final.token_ids, final.logprobs),
            "finish_reason": finish_reason, "stop_reason": final.stop_reason,
            **({"token_ids": final.token_ids} if body.return_token_ids else {})})
    extra = {"prompt_token_ids": prompt_token_ids} if body.return_token_ids else {}
    return report_ignored(body, JSONResponse(
        {**header, "object": "chat.completion", "choices": result,
         "usage": _usage(prompt_token_ids, finals), **extra}), ROUTE)


def _checked_answer(body: ChatCompletionRequest, max_model_len: int,
                    parsers: ChatParsers | None, limits: SpecLimits,
                    prompt_param: str) -> ChatAnswerSetup:
    for param in ("messages", "tools", "documents", "chat_template_kwargs"):
        check_text_length(getattr(body, param), max_model_len,
                          prompt_param if param == "messages" else param)
    return prepare_chat_answer(body, parsers, limits)


def _logprobs(body: ChatCompletionRequest, text_of: lp.TokenText, token_ids: list[int],
              entries: list[Any] | None) -> dict[str, Any] | None:
    if not body.logprobs:
        return None
    return lp.chat_logprobs(text_of, token_ids, entries or [], body.top_logprobs or 0)


def _usage(prompt: list[int], outputs: Sequence[RequestOutput | None]) -> dict[str, int]:
    completion = sum(len(o.token_ids) for o in outputs if o is not None)
    return {"prompt_tokens": len(prompt), "completion_tokens": completion,
            "total_tokens": len(prompt) + completion}


def _chunk(header: dict[str, Any], index: int, delta: dict[str, Any],
           finish_reason: str | None, stop_reason: str | int | None = None,
           logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": logprobs,
              "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return {**header, "object": "chat.completion.chunk", "choices": [choice]}


async def _chunks(outputs: AsyncGenerator[tuple[int, RequestOutput], None],
                  header: dict[str, Any], body: ChatCompletionRequest, choices: list[Choice],
                  text_of: lp.TokenText, streams: list[MessageStream], *,
                  include_usage: bool, continuous_usage: bool
                  ) -> AsyncGenerator[dict[str, Any], None]:
    usage_field: dict[str, Any] = {"usage": None} if include_usage else {}
    latest: list[RequestOutput | None] = [None] * len(choices)
    prompt = choices[0].prompt_token_ids
    async with aclosing(outputs):
        for choice in choices:  # each choice opens with its role, as OpenAI's do
            yield {**_chunk(header, choice.index, {"role": "assistant", "content": ""}, None),
                   **usage_field}
        async for index, output in outputs:
            latest[index] = output
            if not (output.delta_text or output.finished or output.delta_logprobs):
                continue
            stream = streams[index]
            deltas = stream.feed(output.delta_text, output.finished)
            if output.finished or (output.delta_logprobs and not deltas):
                deltas = deltas or [{}]  # the finish reason (or logprobs) needs a chunk
            logprobs = _logprobs(body, text_of, output.delta_token_ids, output.delta_logprobs)
            for i, delta in enumerate(deltas):
                is_last = output.finished and i == len(deltas) - 1
                chunk = _chunk(header, index, delta,
                               stream.finish_reason(output.finish_reason) if is_last else None,
                               output.stop_reason, logprobs if i == 0 else None)
                if include_usage:
                    chunk["usage"] = _usage(prompt, latest) if continuous_usage else None
                yield chunk
    if include_usage:
        yield {**header, "object": "chat.completion.chunk", "choices": [],
               "usage": _usage(prompt, latest)}
