"""The processor: parse the request, embed the query and the documents, rank."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, Field, ValidationError

from gateway.plugins import IOProcessor

_MAX_PENDING = 4096  # requests between pre_process and post_process we remember


class SearchRequest(BaseModel):
    """`data` of a /pooling request."""

    query: str = Field(min_length=1)
    documents: list[str] = Field(min_length=1, max_length=1024)
    #: How many of the best documents to return (None: all of them).
    top_k: int | None = Field(None, ge=1)


class SearchResult(BaseModel):
    index: int  # the document's position in the request
    document: str
    score: float  # cosine similarity to the query, -1..1


class SearchResponse(BaseModel):
    query: str
    results: list[SearchResult]  # best first


class SemanticSearchProcessor(IOProcessor[SearchRequest, SearchResponse]):
    """Runs in the API-server process. `pre_process` remembers each request's documents
    until its `post_process`."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self._pending: OrderedDict[str | None, SearchRequest] = OrderedDict()
        self._lock = threading.Lock()

    def parse_data(self, data: object) -> SearchRequest:
        if not isinstance(data, dict):
            raise ValueError("data must be an object with `query` and `documents`")
        try:
            request = SearchRequest.model_validate(data)
        except ValidationError as exc:  # one short line per problem, for the client
            raise ValueError("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                       for e in exc.errors())) from None
        if any(not document for document in request.documents):
            raise ValueError("documents must not contain an empty string")
        return request

    def pre_process(self, prompt: SearchRequest, request_id: str | None = None,
                    **kwargs: Any) -> list[str]:
        with self._lock:
            self._pending[request_id] = prompt
            while len(self._pending) > _MAX_PENDING:  # requests that failed in the engine
                self._pending.popitem(last=False)
        return [prompt.query, *prompt.documents]

    def post_process(self, model_output: Sequence[Any], request_id: str | None = None,
                     **kwargs: Any) -> SearchResponse:
        with self._lock:
            request = self._pending.pop(request_id)
        vectors = np.stack([np.asarray(output.outputs.data, dtype=np.float32)
                            for output in model_output])
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        scores = vectors[1:] @ vectors[0]
        order = np.argsort(-scores, kind="stable")[:request.top_k]
        return SearchResponse(query=request.query, results=[
            SearchResult(index=int(i), document=request.documents[i], score=float(scores[i]))
            for i in order])
