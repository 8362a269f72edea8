"""POST /v1/responses (task `generate`): OpenAI's Responses API as vLLM serves it, on the
chat path (front end). The request becomes a chat request (responses_input.py), so the
chat template, sampling, structured outputs and the tool and reasoning parsers are the
chat route's own; the answer comes back as output items (responses_output.py), whole or
as the Responses API's events (responses_stream.py), and is kept for `previous_response_id`
and GET /v1/responses/{id} unless `store` is false (responses_store.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.responses import Response

from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.http.json_body import JSONBodyRoute
from gateway.frontend.http.responses import JSONResponse
from gateway.frontend.openai import logprobs as lp
from gateway.frontend.openai.chat import ChatRun, prepare_chat_run
from gateway.frontend.openai.chat_output import AnswerParser, MessageStream
from gateway.frontend.openai.fanout import open_streams, plan_choices, run_to_end
from gateway.frontend.openai.generation import STREAM_RESPONSES, SSEResponse
from gateway.frontend.openai.ignored_fields import report_ignored
from gateway.frontend.openai.lora import served_name
from gateway.frontend.openai.protocol import ResponsesRequest
from gateway.frontend.openai.responses_input import (
    RESPONSES_PARAMS,
    chat_request,
    check_responses_fields,
    has_logprobs,
    input_messages,
    items_as_messages,
)
from gateway.frontend.openai.responses_output import OutputItems
from gateway.frontend.openai.responses_store import ResponseStore
from gateway.frontend.openai.responses_stream import (
    TokenLogprobs,
    response_events,
    sse_events,
)
from gateway.frontend.server_state import ServerState, server_state
from gateway.outputs import RequestOutput

router = APIRouter(route_class=JSONBodyRoute)
ROUTE = "/v1/responses"
_RESPONSES: dict[int | str, dict[str, Any]] = {200: {
    "description": "The response: JSON, or with `stream: true` the Responses API's "
    "server-sent events (`event:` its type, `data:` its JSON).",
    "content": STREAM_RESPONSES[200]["content"]}}


@router.post(ROUTE, responses=_RESPONSES)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    """OpenAI's Responses API (text in, text and function calls out)."""
    state = server_state(request)
    check_responses_fields(body)
    conversation = _history(body, state.responses_store) + input_messages(body)
    run = await _prepare(body, state, conversation)
    response_id = body.request_id or f"resp_{uuid.uuid4().hex}"
    choices = plan_choices(response_id, [run.prompt_token_ids], [run.params], 1)
    tokenizer = state.engine_client.tokenizer
    items = OutputItems(MessageStream(AnswerParser(run.answer.plan, run.answer.parsers,
                                                   tokenizer)))
    logprobs = _logprobs_of(body, lp.TokenText(tokenizer))
    created_at = int(time.time())

    def respond(final: RequestOutput | None) -> dict[str, Any]:
        """The response object; once finished, kept when the request asks."""
        response = _response_object(body, run, state, response_id, created_at, items, final)
        if final is not None and body.store:
            state.responses_store.put(response_id, conversation, response)
        return response

    if body.stream:
        outputs = await open_streams(state.engine_client, request, choices)
        return report_ignored(body, SSEResponse(sse_events(response_events(
            outputs, items, respond, logprobs))), ROUTE)
    (final,) = await run_to_end(state.engine_client, request, choices)
    if logprobs is not None:
        items.add_logprobs(logprobs(final.token_ids, final.logprobs))
    items.feed(final.text, True)
    items.finish(is_truncated=final.finish_reason == "length")
    return report_ignored(body, JSONResponse(respond(final)), ROUTE)


@router.get(ROUTE + "/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> Response:
    """A response kept by the server (`store`, the default), while it is kept."""
    if request.query_params:  # stream, starting_after, include: not served
        name = next(iter(request.query_params))[:40]
        raise OpenAIError(400, f"{name}: no query parameter is supported here; the kept "
                          "response is returned whole.", param=name)
    stored = server_state(request).responses_store.get(response_id)
    if stored is None:
        raise _not_found(param=None)
    return JSONResponse(stored.response)


def _logprobs_of(body: ResponsesRequest, text_of: lp.TokenText) -> TokenLogprobs | None:
    """Tokens' log-probabilities in the output text's shape, when the request asks."""
    if not has_logprobs(body):
        return None
    num_top = body.top_logprobs or 0
    return lambda token_ids, entries: lp.chat_logprobs(
        text_of, token_ids, entries or [], num_top)["content"]


def _history(body: ResponsesRequest, store: ResponseStore) -> list[dict[str, Any]]:
    """The conversation up to and including the previous response's answer."""
    if body.previous_response_id is None:
        return []
    stored = store.get(body.previous_response_id)
    if stored is None:
        raise _not_found(param="previous_response_id")
    return stored.messages + items_as_messages(stored.response["output"],
                                               "previous_response_id")


def _not_found(param: str | None) -> OpenAIError:
    # The id is not echoed: an error body never repeats client text.
    return OpenAIError(404, "No stored response has this id (it was stored with store: "
                       "false, or is older or fewer than the server keeps).", param=param,
                       code="response_not_found")


async def _prepare(body: ResponsesRequest, state: ServerState,
                   conversation: list[dict[str, Any]]) -> ChatRun:
    """The chat run that answers `body`; the chat path's errors name this API's fields."""
    try:
        chat = chat_request(body, conversation, state.serving_options.spec_limits)
        run = await prepare_chat_run(chat, state, prompt_param="input",
                                     tokens_param="max_output_tokens")
    except ValidationError as exc:
        raise OpenAIError(400, f"input: {exc.errors()[0]['msg']}", param="input") from None
    except OpenAIError as exc:
        if exc.param in RESPONSES_PARAMS:
            name = RESPONSES_PARAMS[exc.param]
            exc.message = exc.message.replace(exc.param, name)
            exc.param = name
        raise
    constraint = run.params.structured_outputs  # the engine names it when it refuses it
    if constraint is not None and constraint.source_param in RESPONSES_PARAMS:
        constraint.source_param = RESPONSES_PARAMS[constraint.source_param]
    return run


def _response_object(body: ResponsesRequest, run: ChatRun, state: ServerState,
                    response_id: str, created_at: int, items: OutputItems,
                    final: RequestOutput | None) -> dict[str, Any]:
    """The `response` object: finished (`final` given) or still in progress."""
    status, incomplete = "in_progress", None
    if final is not None:
        status = "incomplete" if final.finish_reason == "length" else "completed"
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
    return {
        "id": response_id, "object": "response", "created_at": created_at,
        "status": status, "error": None, "incomplete_details": incomplete,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "model": served_name(run.params, state.engine_client.model_name),
        "output": list(items.items) if final is not None else [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning, "store": bool(body.store),
        "temperature": run.params.temperature, "top_p": run.params.top_p,
        "text": body.text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
        "truncation": "disabled", "background": False,
        "service_tier": body.service_tier or "auto", "metadata": body.metadata or {},
        "user": body.user,
        "usage": None if final is None else _usage(final, items, state),
    }


def _usage(final: RequestOutput, items: OutputItems, state: ServerState) -> dict[str, Any]:
    tokenizer = state.engine_client.tokenizer
    reasoning = len(tokenizer.encode(items.reasoning, add_special_tokens=False)) \
        if items.reasoning else 0
    prompt, output = len(final.prompt_token_ids), len(final.token_ids)
    # The prefix cache's hits are not counted per request: both cache figures are 0.
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": min(reasoning, output)},
            "total_tokens": prompt + output}
