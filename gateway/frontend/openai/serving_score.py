"""POST /score, /v1/score (sentence-pair scores) and /rerank, /v1/rerank, /v2/rerank
(documents ordered by relevance to a query): vLLM's routes and shapes (API-server process).

How a pair is scored depends on the model's tasks: a cross-encoder (task `score`: a
sequence classifier with one label) reads both texts as one input through the tokenizer's
pair template (BERT: [CLS] a [SEP] b [SEP], the second text with token type 1; RoBERTa:
<s> a </s></s> b </s>), and its logit through the model's activation is the score; an
embedding model (task `embed`) embeds each text once, and the score is the cosine
similarity of the two vectors. Each pair (or text) is one engine request, run concurrently.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.http.json_body import JSONBodyRoute
from gateway.frontend.http.responses import JSONResponse
from gateway.frontend.openai.embeddings import MAX_INPUTS, input_token_ids, pool, token_limit
from gateway.frontend.openai.ignored_fields import report_ignored
from gateway.frontend.openai.sampling import check_model
from gateway.frontend.openai.score_protocol import (
    ActivationFields,
    RerankRequest,
    ScoreRequest,
    check_not_empty,
)
from gateway.frontend.server_state import server_state
from gateway.plugins import EngineClient
from gateway.pooling_params import PoolingParams

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/score")
async def create_score(body: ScoreRequest, request: Request) -> Response:
    """Score each pair of `text_1` and `text_2`."""
    return report_ignored(body, await _score(body, request), "/score")


@router.post("/v1/score")
async def create_score_v1(body: ScoreRequest, request: Request) -> Response:
    return report_ignored(body, await _score(body, request), "/v1/score")


@router.post("/rerank")
async def rerank(body: RerankRequest, request: Request) -> Response:
    """Order `documents` by relevance to `query`, best first."""
    return report_ignored(body, await _rerank(body, request), "/rerank")


@router.post("/v1/rerank")
async def rerank_v1(body: RerankRequest, request: Request) -> Response:
    return report_ignored(body, await _rerank(body, request), "/v1/rerank")


@router.post("/v2/rerank")
async def rerank_v2(body: RerankRequest, request: Request) -> Response:
    return report_ignored(body, await _rerank(body, request), "/v2/rerank")


async def _score(body: ScoreRequest, request: Request) -> Response:
    engine_client = _checked(body, request)
    firsts, seconds, param = body.pairs()
    request_id = f"score-{uuid.uuid4().hex}"
    scores, num_tokens = await score_pairs(request, firsts, seconds, body, request_id, param)
    return JSONResponse({
        "id": request_id, "object": "list", "created": int(time.time()),
        "model": engine_client.model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


async def _rerank(body: RerankRequest, request: Request) -> Response:
    engine_client = _checked(body, request)
    if not body.documents:
        raise OpenAIError(400, "`documents` must hold at least one document.",
                          param="documents")
    if body.top_n < 0:
        raise OpenAIError(400, f"top_n must be 0 (every document) or more, got {body.top_n}.",
                          param="top_n")
    check_not_empty([body.query], "query")
    check_not_empty(body.documents, "documents")
    request_id = f"rerank-{uuid.uuid4().hex}"
    documents = body.documents
    scores, num_tokens = await score_pairs(request, [body.query] * len(documents), documents,
                                           body, request_id, "documents")
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[:body.top_n or None]
    results = [{"index": i, **({"document": {"text": documents[i]}}
                               if body.return_documents else {}),
                "relevance_score": scores[i]} for i in order]
    return JSONResponse({"id": request_id, "model": engine_client.model_name,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
                         "results": results})


def _checked(body: ActivationFields, request: Request) -> EngineClient:
    engine_client = server_state(request).engine_client
    check_model(body.model, engine_client.model_name)
    body.check_priority()
    return engine_client


async def score_pairs(request: Request, firsts: list[str], seconds: list[str],
                      body: ActivationFields, request_id: str,
                      param: str) -> tuple[list[float], int]:
    """One score per pair (firsts[i], seconds[i]), and the prompt tokens that took."""
    if len(seconds) > MAX_INPUTS:
        raise OpenAIError(400, f"{len(seconds)} pairs to score; at most {MAX_INPUTS} per "
                          f"request.", param=param)
    if "score" in server_state(request).engine_client.supported_tasks:
        return await _cross_encode(request, firsts, seconds, body, request_id, param)
    return await _cosine(request, firsts, seconds, body, request_id, param)


async def _cross_encode(request: Request, firsts: list[str], seconds: list[str],
                        body: ActivationFields, request_id: str,
                        param: str) -> tuple[list[float], int]:
    engine_client = server_state(request).engine_client
    limit = token_limit(body.truncate_prompt_tokens, engine_client.max_model_len)
    truncate = body.truncate_prompt_tokens is not None
    encoded = [encode_pair(engine_client.tokenizer, first, second, limit, truncate, param)
               for first, second in zip(firsts, seconds)]
    activation = body.resolved_activation()
    params = [PoolingParams(task="score", use_activation=activation, second_segment_start=start)
              for _, start in encoded]
    prompts = [ids for ids, _ in encoded]
    outputs = await pool(engine_client, request, prompts, params, request_id)
    return [float(o.outputs.data[0]) for o in outputs], sum(map(len, prompts))


async def _cosine(request: Request, firsts: list[str], seconds: list[str],
                  body: ActivationFields, request_id: str,
                  param: str) -> tuple[list[float], int]:
    if body.resolved_activation() is False:
        raise OpenAIError(400, "use_activation false applies to cross-encoders; this model "
                          "scores by the cosine similarity of embeddings.",
                          param="use_activation")
    engine_client = server_state(request).engine_client
    texts = list(dict.fromkeys(firsts + seconds))  # each text embedded once
    prompts = input_token_ids(texts, engine_client, body.truncate_prompt_tokens, param=param)
    outputs = await pool(engine_client, request, prompts, PoolingParams(task="embed"),
                         request_id)
    vectors = {text: output.outputs.data for text, output in zip(texts, outputs)}
    scores = [_cosine_similarity(vectors[a], vectors[b]) for a, b in zip(firsts, seconds)]
    return scores, sum(map(len, prompts))


def _cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b)) / max(norms, 1e-12)


def encode_pair(tokenizer: Any, first: str, second: str, limit: int, truncate: bool,
                param: str) -> tuple[list[int], int | None]:
    """The pair's token ids by the tokenizer's pair template, and where token type 1
    begins (None: the template gives every token type 0). Over `limit` tokens: cut
    longest first (transformers' truncation=True) when `truncate`, else a 400."""
    fast = tokenizer.tokenizer  # the `tokenizers` Tokenizer
    if not first or not second:
        raise OpenAIError(400, f"`{param}` holds an empty text.", param=param)
    a = fast.encode(first, add_special_tokens=False)
    b = fast.encode(second, add_special_tokens=False)
    budget = limit - fast.num_special_tokens_to_add(is_pair=True)
    if len(a) + len(b) > budget:
        if not truncate or budget < 2:
            raise OpenAIError(400, f"A pair has {len(a) + len(b) + limit - budget} tokens, "
                              f"more than the maximum of {limit}; shorten it, or set "
                              f"truncate_prompt_tokens to cut it.", param=param)
        kept_a, kept_b = _longest_first(len(a), len(b), budget)
        a.truncate(kept_a)
        b.truncate(kept_b)
    encoding = fast.post_process(a, b, add_special_tokens=True)
    ids, types = list(encoding.ids), list(encoding.type_ids)
    start = types.index(1) if 1 in types else None
    if start is not None and types[start:] != [1] * (len(types) - start):
        raise OpenAIError(400, "The tokenizer's pair template mixes token types; it is not "
                          "supported for scoring.", param=param)
    return ids, start


def _longest_first(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """The lengths kept by `tokenizers`' longest-first truncation (what transformers'
    truncation=True does): the shorter text is kept whole if the longer can fill the rest,
    else both get half of `budget` (the longer one the odd token)."""
    shorter = min(len_a, len_b)
    kept_shorter, kept_longer = shorter, max(shorter, budget - shorter)
    if kept_shorter + kept_longer > budget:
        kept_shorter, kept_longer = budget // 2, budget // 2 + budget % 2
    return (kept_longer, kept_shorter) if len_a > len_b else (kept_shorter, kept_longer)
