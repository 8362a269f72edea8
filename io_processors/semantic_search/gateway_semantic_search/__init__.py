"""Semantic search as an IO processor: `POST /pooling` takes a query and documents, and
answers the documents ranked by cosine similarity to the query.

The entry point (group `vllm.io_processor_plugins`) is `register`, a function returning
the processor class's qualname; the server calls it only when it was started with
`--io-processor-plugin semantic_search` (or the model's config.json names it), and needs an
embedding model.
"""

from __future__ import annotations


def register() -> str:
    """The `vllm.io_processor_plugins` entry point."""
    return "gateway_semantic_search.processor:SemanticSearchProcessor"
