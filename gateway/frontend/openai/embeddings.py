"""POST /v1/embeddings (task `embed`; API-server process): text or token ids in, one vector per
input out.

Each input is one engine request. A request's inputs are admitted together (they count
against --max-num-queued-reqs at once) and run in the window of fanout.py, at most half of
--max-num-seqs at a time, so the engine batches them with other clients' inputs rather
than queueing those behind all of them. A client that disconnects aborts all of them.
"""

from __future__ import annotations

import base64
import functools
import time
import uuid
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.frontend.engine_client.errors import EngineDeadError
from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.http.json_body import JSONBodyRoute
from gateway.frontend.http.responses import JSONResponse
from gateway.frontend.openai.fanout import request_share, run_in_window
from gateway.frontend.openai.generation import (
    engine_dead_error,
    engine_error,
    until_disconnected,
)
from gateway.frontend.openai.ignored_fields import report_ignored
from gateway.frontend.openai.protocol import EmbeddingRequest
from gateway.frontend.openai.sampling import check_model, check_token_ids
from gateway.frontend.server_state import server_state
from gateway.outputs import PoolingRequestOutput
from gateway.plugins import EngineClient
from gateway.pooling_params import PoolingParams

router = APIRouter(route_class=JSONBodyRoute)

Input = str | list[str] | list[int] | list[list[int]]
MAX_INPUTS = 2048  # items in one request's `input` (OpenAI's limit)


@router.post("/v1/embeddings")
async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
    """OpenAI's embeddings API, plus vLLM's `truncate_prompt_tokens`, `add_special_tokens`
    and `normalize`."""
    engine_client = server_state(request).engine_client
    check_model(body.model, engine_client.model_name)
    response = await pooled_list_response(body, body.input, request, "embd", "embedding",
                                          "embedding")
    return report_ignored(body, response, "/v1/embeddings")


async def pooled_list_response(body: EmbeddingRequest, inputs: Input, request: Request,
                               id_prefix: str, item_object: str, item_key: str) -> Response:
    """Pool `inputs` and answer OpenAI's list shape: one item per input, in order, each
    `{"object": item_object, "index": i, item_key: vector}`, with the prompt tokens used."""
    engine_client = server_state(request).engine_client
    prompts = input_token_ids(inputs, engine_client, body.truncate_prompt_tokens,
                              body.add_special_tokens)
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    outputs = await pool(engine_client, request, prompts, pooling_params(body, engine_client),
                         request_id)
    data = [{"object": item_object, "index": i,
             item_key: encode_vector(output.outputs.data, body.encoding_format)}
            for i, output in enumerate(outputs)]
    return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()),
                         "model": engine_client.model_name, "data": data,
                         "usage": usage(prompts)})


def input_token_ids(inputs: Input, engine_client: EngineClient, truncate: int | None,
                    add_special_tokens: bool = True, param: str = "input") -> list[list[int]]:
    """One token-id list per input. Too long: cut to `truncate` tokens when the request
    asked for it (-1: the model's limit), else a 400."""
    items: list[Any] = [inputs] if isinstance(inputs, str) or (
        inputs and isinstance(inputs[0], int)) else list(inputs)
    if not items:
        raise OpenAIError(400, f"`{param}` must not be empty.", param=param)
    if len(items) > MAX_INPUTS:
        raise OpenAIError(400, f"`{param}` has {len(items)} items; at most {MAX_INPUTS} per "
                          f"request.", param=param)
    limit = token_limit(truncate, engine_client.max_model_len)
    tokenizer = engine_client.tokenizer
    prompts = []
    for index, item in enumerate(items):
        where = param if len(items) == 1 else f"{param}[{index}]"
        if isinstance(item, str):
            if not item:
                raise OpenAIError(400, f"`{where}` is an empty string.", param=param)
            token_ids = tokenizer.encode(item, add_special_tokens=add_special_tokens)
        else:
            token_ids = list(item)
            check_token_ids(token_ids, tokenizer.vocab_size, param)
        if not token_ids:
            raise OpenAIError(400, f"`{where}` has no tokens.", param=param)
        if len(token_ids) > limit:
            if truncate is None:
                raise OpenAIError(400, f"`{where}` has {len(token_ids)} tokens, more than the "
                                  f"model's maximum of {limit}; shorten it, or set "
                                  f"truncate_prompt_tokens to cut it.", param=param)
            token_ids = _truncate(token_ids, limit, tokenizer, keep_last=isinstance(item, str)
                                  and add_special_tokens)
        prompts.append(token_ids)
    return prompts


def token_limit(truncate: int | None, max_model_len: int) -> int:
    """The most tokens an input may have: `truncate` (-1, None: the model's maximum)."""
    if truncate is None or truncate == -1:
        return max_model_len
    if not 1 <= truncate <= max_model_len:
        raise OpenAIError(400, f"truncate_prompt_tokens must be -1 or between 1 and the "
                          f"model's maximum of {max_model_len}, got {truncate}.",
                          param="truncate_prompt_tokens")
    return truncate


def _truncate(token_ids: list[int], limit: int, tokenizer: Any, keep_last: bool) -> list[int]:
    """The first `limit` tokens; when the tokenizer closed the text with a special token
    ([SEP], </s>), it stays last, as the model was trained to see it."""
    if keep_last and limit > 1 and token_ids[-1] in tokenizer.all_special_ids:
        return token_ids[:limit - 1] + token_ids[-1:]
    return token_ids[:limit]


def pooling_params(body: EmbeddingRequest, engine_client: EngineClient) -> PoolingParams:
    """The request's pooling parameters; `dimensions` is refused unless the model can."""
    if body.dimensions is None:
        return PoolingParams(normalize=body.normalize)
    info = engine_client.model_info
    size = int(info.hidden_size) if info is not None else None
    config = info.hf_config if info is not None else {}
    matryoshka = config.get("matryoshka_dimensions") or []
    if config.get("is_matryoshka") or matryoshka:
        allowed = body.dimensions in matryoshka if matryoshka else (
            size is None or 1 <= body.dimensions <= size)
        if not allowed:
            choices = ", ".join(map(str, matryoshka)) or f"1..{size}"
            raise OpenAIError(400, f"dimensions must be one of {choices}, got "
                              f"{body.dimensions}.", param="dimensions")
        return PoolingParams(normalize=body.normalize, dimensions=body.dimensions)
    if body.dimensions != size:
        raise OpenAIError(400, f"This model does not support `dimensions` (it is not a "
                          f"Matryoshka model); its embeddings have {size} values.",
                          param="dimensions")
    return PoolingParams(normalize=body.normalize)


async def pool(engine_client: EngineClient, request: Request, prompts: list[list[int]],
               params: PoolingParams | list[PoolingParams],
               request_id: str) -> list[PoolingRequestOutput]:
    """Pool every prompt through the engine (with `params`, or each with its own), admitted
    together and run in a window; outputs in prompt order."""
    limit = server_state(request).serving_options.max_num_queued_reqs
    if limit is not None and len(prompts) > limit:  # it could never be admitted
        raise OpenAIError(400, f"The request has {len(prompts)} inputs; this server admits "
                          f"at most {limit} at once (--max-num-queued-reqs {limit}).",
                          param="input")
    each = params if isinstance(params, list) else [params] * len(prompts)
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}"
                                                  for i in range(len(prompts))]

    async def run() -> list[PoolingRequestOutput]:
        try:
            engine_client.reserve(ids)
            return await run_in_window([
                functools.partial(engine_client.encode, prompt, one, rid)
                for prompt, one, rid in zip(prompts, each, ids)], request_share(engine_client))
        except EngineDeadError as exc:
            raise engine_dead_error(engine_client, exc) from exc
        finally:
            engine_client.release(ids)

    outputs = await until_disconnected(request, run())
    for output in outputs:
        error = engine_error(output)
        if error is not None:
            raise error
    return outputs


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A vector as OpenAI sends it: a list of floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode("ascii")
    return vector.tolist()  # type: ignore[no-any-return]


def usage(prompts: list[list[int]]) -> dict[str, int]:
    num_tokens = sum(len(p) for p in prompts)
    return {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
