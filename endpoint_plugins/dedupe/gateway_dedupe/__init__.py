"""POST /v1/dedupe: group near-duplicate texts by the cosine similarity of their
embeddings (an endpoint plugin for embedding models).

An example of a plugin that pools through the engine: `init_state` receives the engine
client, and the route embeds every text with `engine_client.encode`, then links each pair
whose similarity reaches the threshold and answers the connected groups. Needs a model
with the `embed` task, so `required_tasks` says so and the server skips this plugin (with a
log line) on a generation model.

Enable it with `VLLM_PLUGINS=dedupe` (endpoint plugins load only when named).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import numpy as np
from fastapi import APIRouter, FastAPI, HTTPException
from pydantic import BaseModel, Field

from gateway.pooling_params import PoolingParams


class DedupeRequest(BaseModel):
    texts: list[str] = Field(min_length=1, max_length=512,
                             description="the texts to compare, each non-empty")
    threshold: float = Field(0.9, ge=-1.0, le=1.0,
                             description="cosine similarity at or above which two texts are "
                                         "duplicates")


class DedupePair(BaseModel):
    first: int
    second: int
    score: float


class DedupeResponse(BaseModel):
    id: str
    model: str
    #: Each group lists the indices of texts that are near-duplicates (transitively), in
    #: order; a text with no duplicate is a group of one.
    groups: list[list[int]]
    pairs: list[DedupePair]  # every pair at or above the threshold, best first
    usage: dict[str, int]


class DedupePlugin:
    """The endpoint plugin (the object the entry point's factory returns)."""

    name = "dedupe"
    required_tasks: tuple[str, ...] | None = ("embed",)

    def __init__(self) -> None:
        self.engine_client: Any = None

    def attach_router(self, app: FastAPI) -> None:
        router = APIRouter(tags=["dedupe"])
        router.add_api_route("/v1/dedupe", self.dedupe, methods=["POST"],
                             response_model=DedupeResponse,
                             summary="Group near-duplicate texts by embedding similarity")
        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        self.engine_client = engine_client

    async def dedupe(self, body: DedupeRequest) -> DedupeResponse:
        request_id = f"dedupe-{uuid.uuid4().hex}"
        prompts = [self._token_ids(i, text) for i, text in enumerate(body.texts)]
        vectors = await self._embed(prompts, request_id)
        scores = vectors @ vectors.T
        first, second = np.nonzero(np.triu(scores >= body.threshold, k=1))
        pairs = sorted((DedupePair(first=int(a), second=int(b), score=float(scores[a, b]))
                        for a, b in zip(first, second)), key=lambda p: -p.score)
        return DedupeResponse(
            id=request_id, model=self.engine_client.model_name,
            groups=_groups(len(prompts), [(p.first, p.second) for p in pairs]), pairs=pairs,
            usage={"prompt_tokens": sum(map(len, prompts)),
                   "total_tokens": sum(map(len, prompts))})

    def _token_ids(self, index: int, text: str) -> list[int]:
        engine = self.engine_client
        if not text:
            raise HTTPException(400, f"texts[{index}] is empty.")
        token_ids = list(engine.tokenizer.encode(text))
        if len(token_ids) > engine.max_model_len:
            raise HTTPException(400, f"texts[{index}] has {len(token_ids)} tokens; the model "
                                f"reads at most {engine.max_model_len}.")
        return token_ids

    async def _embed(self, prompts: list[list[int]], request_id: str) -> np.ndarray:
        """[N, D] unit vectors. Cancelling (a client that went away) aborts them all."""
        params = PoolingParams(normalize=True)
        outputs = await asyncio.gather(*(
            self.engine_client.encode(prompt, params, f"{request_id}-{i}")
            for i, prompt in enumerate(prompts)))
        if any(output.error for output in outputs):
            raise HTTPException(500, f"Embedding failed for request {request_id}.")
        return np.stack([output.outputs.data for output in outputs])


def _groups(count: int, links: list[tuple[int, int]]) -> list[list[int]]:
    """Connected components of `count` items joined by `links`, each sorted, by first item."""
    parent = list(range(count))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in links:
        parent[root(a)] = root(b)
    groups: dict[int, list[int]] = {}
    for i in range(count):
        groups.setdefault(root(i), []).append(i)
    return sorted(groups.values())


def make_plugin() -> DedupePlugin:
    """The `vllm.endpoint_plugins` entry point: a zero-argument factory."""
    return DedupePlugin()
