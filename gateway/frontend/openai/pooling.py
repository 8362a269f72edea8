"""POST /pooling: the raw pooling API (task `embed`), or, when the server runs an IO
processor (task `plugin`), the processor's own request and response.

With an IO processor: `data` -> `parse_data` (a ValueError is a 400 with its message) ->
`pre_process` (one prompt or a sequence: text, {"prompt": text} or
{"prompt_token_ids": [...]}) -> the engine pools each prompt -> `post_process` (outputs
in prompt order) -> `{"request_id", "created_at", "data"}` (vLLM's response shape).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.http.json_body import JSONBodyRoute
from gateway.frontend.http.responses import JSONResponse
from gateway.frontend.openai.embeddings import input_token_ids, pool, pooled_list_response
from gateway.frontend.openai.ignored_fields import report_ignored
from gateway.frontend.openai.protocol import PoolingRequest
from gateway.frontend.openai.sampling import check_model, check_token_ids
from gateway.frontend.server_state import server_state
from gateway.logger import init_logger
from gateway.plugins import EngineClient, IOProcessor
from gateway.pooling_params import PoolingParams

logger = init_logger(__name__)

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/pooling")
async def create_pooling(body: PoolingRequest, request: Request) -> Response:
    """Pool inputs, or run the IO processor on `data`."""
    engine_client = server_state(request).engine_client
    check_model(body.model, engine_client.model_name)
    processor = server_state(request).io_processor
    if processor is not None:
        return report_ignored(body, await _run_io_processor(processor, body, request),
                              "/pooling")
    if body.input is None:
        raise OpenAIError(400, "`input` is required.", param="input")
    response = await pooled_list_response(body, body.input, request, "pool", "pooling", "data")
    return report_ignored(body, response, "/pooling")


async def _run_io_processor(processor: IOProcessor[Any, Any], body: PoolingRequest,
                            request: Request) -> Response:
    engine_client = server_state(request).engine_client
    name = type(processor).__name__
    if "data" not in body.model_fields_set:
        raise OpenAIError(400, f"`data` is required: this server's /pooling runs the IO "
                          f"processor {name}.", param="data")
    request_id = f"pool-{uuid.uuid4().hex}"
    try:
        parsed = processor.parse_data(body.data)
        prompts = await processor.pre_process_async(parsed, request_id)
    except ValueError as exc:  # includes pydantic's ValidationError
        raise OpenAIError(400, f"{name} refused the data: {exc}", param="data") from None
    except Exception:
        logger.exception("IO processor %s failed before pooling (request %s).", name,
                         request_id)
        raise OpenAIError(500, f"The IO processor failed on request {request_id}.",
                          code="io_processor_error") from None
    params = processor.merge_pooling_params(PoolingParams())
    if not isinstance(params, PoolingParams):
        logger.error("IO processor %s: merge_pooling_params returned %r, not PoolingParams.",
                     name, params)
        raise OpenAIError(500, f"The IO processor failed on request {request_id}.",
                          code="io_processor_error")
    token_ids = [_prompt_token_ids(p, engine_client) for p in _as_list(prompts)]
    outputs = await pool(engine_client, request, token_ids, params, request_id)
    try:
        result = await processor.post_process_async(outputs, request_id)
    except Exception:
        logger.exception("IO processor %s failed after pooling (request %s).", name,
                         request_id)
        raise OpenAIError(500, f"The IO processor failed on request {request_id}.",
                          code="io_processor_error") from None
    if hasattr(result, "model_dump"):  # a pydantic model
        result = result.model_dump(mode="json")
    return JSONResponse({"request_id": request_id, "created_at": int(time.time()),
                         "data": result})


def _as_list(prompts: Any) -> Sequence[Any]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    return list(prompts)


def _prompt_token_ids(prompt: Any, engine_client: EngineClient) -> list[int]:
    """The token ids of one prompt the processor made."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        token_ids = list(prompt["prompt_token_ids"])
        check_token_ids(token_ids, engine_client.tokenizer.vocab_size, "data")
        if not token_ids or len(token_ids) > engine_client.max_model_len:
            raise OpenAIError(400, f"A prompt made from `data` has {len(token_ids)} tokens; "
                              f"it must have 1 to {engine_client.max_model_len}.",
                              param="data")
        return token_ids
    text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
    if not isinstance(text, str):
        raise OpenAIError(500, "The IO processor made a prompt that is neither text nor "
                          "token ids.", code="io_processor_error")
    return input_token_ids(text, engine_client, None, param="data")[0]
