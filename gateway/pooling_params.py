"""Pooling parameters: how an embedding request pools, shared by every process.

Like `SamplingParams`, plain data that travels as msgpack from the front end to the engine
core and the workers.
"""

from __future__ import annotations

import msgspec


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One pooling request. The pooling method itself (mean, CLS, last token) is the
    model's, read from its config; a request can only ask for less."""

    #: "embed" (a vector), "classify" (one value per label) or "score" (a cross-encoder's
    #: one value for a sentence pair); the model must support it.
    task: str = "embed"
    #: L2-normalise the pooled vector; None: the model's own choice (its config's
    #: Normalize module, else no).
    normalize: bool | None = None
    #: Keep the first `dimensions` values (Matryoshka models only; the front end refuses
    #: it for the others); None: all of them.
    dimensions: int | None = None
    #: classify and score: apply the model's activation (softmax, sigmoid, ...) to the
    #: logits; None: yes (vLLM's `use_activation`).
    use_activation: bool | None = None
    #: A sentence pair for a BERT cross-encoder: the index of the second text's first token
    #: (token type 1 from there to the end; vLLM sends token types so compressed too).
    #: None: one text, every token type 0.
    second_segment_start: int | None = None
