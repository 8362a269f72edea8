"""POST /v1/completions (task `generate`): a prompt (text or token ids) in, text out,
whole or streamed as SSE."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.engine.client import RequestOutput
from gateway.entrypoints.errors import OpenAIError
from gateway.entrypoints.openai.generation import (
    STREAM_RESPONSES,
    SSEResponse,
    generate_to_end,
    open_stream,
    sse_body,
    usage_of,
)
from gateway.entrypoints.openai.protocol import CompletionRequest
from gateway.entrypoints.openai.structured_outputs import structured_outputs_of
from gateway.entrypoints.openai.sampling import (
    check_model,
    check_token_ids,
    check_unsupported,
    resolve_max_tokens,
    to_sampling_params,
)
from gateway.entrypoints.responses import JSONResponse

router = APIRouter()


@router.post("/v1/completions", responses=STREAM_RESPONSES)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    """OpenAI's completions API (n=1; one prompt per request)."""
    engine_client = request.app.state.engine_client
    check_model(body.model, engine_client.model_name)
    check_unsupported(body)
    tokenizer = engine_client.tokenizer
    prompt_token_ids = prompt_to_token_ids(body.prompt, tokenizer)
    max_tokens = resolve_max_tokens(body.max_tokens, len(prompt_token_ids),
                                    engine_client.max_model_len, "prompt")
    params = to_sampling_params(body, max_tokens, tokenizer.vocab_size)
    params.structured_outputs = structured_outputs_of(body)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    header = {"id": request_id, "object": "text_completion", "created": int(time.time()),
              "model": engine_client.model_name}
    echo = _prompt_text(body.prompt, tokenizer) if body.echo else ""
    if body.stream:
        outputs = await open_stream(engine_client, request, prompt_token_ids, params,
                                    request_id)
        options = body.stream_options
        return SSEResponse(sse_body(_chunks(
            outputs, header, echo, include_usage=bool(options and options.include_usage),
            continuous_usage=bool(options and options.continuous_usage_stats))))
    final = await generate_to_end(engine_client, request, prompt_token_ids, params,
                                  request_id)
    choice = _choice(echo + final.text, final)
    return JSONResponse({**header, "choices": [choice], "usage": usage_of(final)})


def prompt_to_token_ids(prompt: str | list[int] | list[str] | list[list[int]],
                        tokenizer: Any) -> list[int]:
    """The prompt's token ids; a batch of more than one prompt is refused."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise OpenAIError(400, f"Only one prompt per request is supported, got "
                              f"{len(prompt)}.", param="prompt")
        prompt = prompt[0]  # type: ignore[assignment]
    if isinstance(prompt, str):
        token_ids: list[int] = tokenizer.encode(prompt)
    else:
        token_ids = list(prompt)  # type: ignore[arg-type]
        check_token_ids(token_ids, tokenizer.vocab_size, "prompt")
    if not token_ids:
        raise OpenAIError(400, "The prompt is empty.", param="prompt")
    return token_ids


def _prompt_text(prompt: Any, tokenizer: Any) -> str:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else str(tokenizer.decode(list(prompt)))


def _choice(text: str, output: RequestOutput) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None,
            "finish_reason": output.finish_reason if output.finished else None,
            "stop_reason": output.stop_reason}


async def _chunks(outputs: AsyncGenerator[RequestOutput, None], header: dict[str, Any],
                  echo: str, *, include_usage: bool, continuous_usage: bool
                  ) -> AsyncGenerator[dict[str, Any], None]:
    last: RequestOutput | None = None
    async with aclosing(outputs):
        async for output in outputs:
            last = output
            if not (output.delta_text or output.finished or echo):
                continue
            chunk = {**header, "choices": [_choice(echo + output.delta_text, output)]}
            echo = ""
            if include_usage:
                chunk["usage"] = usage_of(output) if continuous_usage else None
            yield chunk
    if include_usage and last is not None:
        yield {**header, "choices": [], "usage": usage_of(last)}
